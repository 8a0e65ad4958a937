-- One LIST partition per tenant for every table that holds content, MACs or keys. Compacting a
-- tenant (VACUUM FULL of its partitions, lib/memories/table_partitions.py) rewrites only its rows and locks only
-- its files: another tenant's reads never wait for it. Partitions are made with the tenant, by a
-- trigger on memory.tenants, in the transaction that creates it. There is no DEFAULT partition: a
-- row for a tenant without partitions fails loudly instead of landing in a shared file.
-- Ids-only tables (memories, lineage, recall cache, control plane) stay as they are.

-- The old tables step aside (their indexes too: index names are per schema), and their rows are
-- copied into the partitioned tables below.
ALTER TABLE memory.memory_versions RENAME TO memory_versions_pre0011;
ALTER INDEX memory.memory_versions_pkey RENAME TO memory_versions_pre0011_pkey;
ALTER INDEX memory.memory_versions_current_mac RENAME TO memory_versions_pre0011_current_mac;
ALTER TABLE derived.keyword_postings RENAME TO keyword_postings_pre0011;
ALTER INDEX derived.keyword_postings_pkey RENAME TO keyword_postings_pre0011_pkey;
ALTER INDEX derived.keyword_postings_by_memory RENAME TO keyword_postings_pre0011_by_memory;
ALTER TABLE derived.summaries RENAME TO summaries_pre0011;
ALTER INDEX derived.summaries_pkey RENAME TO summaries_pre0011_pkey;
ALTER TABLE derived.prompt_snapshots RENAME TO prompt_snapshots_pre0011;
ALTER INDEX derived.prompt_snapshots_pkey RENAME TO prompt_snapshots_pre0011_pkey;
ALTER INDEX derived.prompt_snapshots_by_run RENAME TO prompt_snapshots_pre0011_by_run;
ALTER TABLE keystore.subject_keys RENAME TO subject_keys_pre0011;
ALTER INDEX keystore.subject_keys_pkey RENAME TO subject_keys_pre0011_pkey;
ALTER INDEX keystore.subject_keys_key_id_key RENAME TO subject_keys_pre0011_key_id_key;
ALTER TABLE keystore.team_keys RENAME TO team_keys_pre0011;
ALTER INDEX keystore.team_keys_pkey RENAME TO team_keys_pre0011_pkey;
ALTER INDEX keystore.team_keys_key_id_key RENAME TO team_keys_pre0011_key_id_key;
ALTER TABLE keystore.tenant_keys RENAME TO tenant_keys_pre0011;
ALTER INDEX keystore.tenant_keys_pkey RENAME TO tenant_keys_pre0011_pkey;
ALTER INDEX keystore.tenant_keys_key_id_key RENAME TO tenant_keys_pre0011_key_id_key;

-- Same columns, defaults, checks and keys as before. A unique key of a partitioned table must
-- hold the partition key, so a key id is unique per tenant (ids are random: it always was).
CREATE TABLE memory.memory_versions (
    tenant_id         text NOT NULL,
    memory_id         text NOT NULL,
    version           integer NOT NULL CHECK (version >= 1),
    shareable         boolean NOT NULL DEFAULT false,
    category          text NOT NULL,
    confidence        double precision NOT NULL CHECK (confidence >= 0 AND confidence <= 1),
    text_ct           bytea NOT NULL,
    text_mac          bytea NOT NULL,
    original_query_ct bytea,
    key_id            text NOT NULL,
    restored_from     integer,
    created_at        timestamptz NOT NULL DEFAULT now(),
    superseded_at     timestamptz,
    PRIMARY KEY (tenant_id, memory_id, version),
    FOREIGN KEY (tenant_id, memory_id) REFERENCES memory.memories (tenant_id, memory_id)
) PARTITION BY LIST (tenant_id);
CREATE INDEX memory_versions_current_mac ON memory.memory_versions (tenant_id, text_mac) WHERE superseded_at IS NULL;

CREATE TABLE derived.keyword_postings (
    tenant_id text NOT NULL,
    token_mac bytea NOT NULL,
    memory_id text NOT NULL,
    version   integer NOT NULL,
    PRIMARY KEY (tenant_id, token_mac, memory_id, version)
) PARTITION BY LIST (tenant_id);
CREATE INDEX keyword_postings_by_memory ON derived.keyword_postings (tenant_id, memory_id, version);

CREATE TABLE derived.summaries (
    tenant_id    text NOT NULL,
    scope        text NOT NULL CHECK (scope IN ('subject', 'team')),
    scope_id     text NOT NULL,
    mode         text NOT NULL CHECK (mode IN ('full', 'summary', 'hybrid')),
    summary_ct   bytea NOT NULL,
    key_id       text NOT NULL,
    sources_hash bytea NOT NULL,
    source_count integer NOT NULL,
    summarizer   text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, scope, scope_id)
) PARTITION BY LIST (tenant_id);

CREATE TABLE derived.prompt_snapshots (
    tenant_id   text NOT NULL,
    snapshot_id text NOT NULL,
    run_id      text NOT NULL,
    subject_id  text NOT NULL,
    prompt_ct   bytea NOT NULL,
    key_id      text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, snapshot_id)
) PARTITION BY LIST (tenant_id);
CREATE INDEX prompt_snapshots_by_run ON derived.prompt_snapshots (tenant_id, run_id);

CREATE TABLE keystore.subject_keys (
    tenant_id     text NOT NULL,
    user_id       text NOT NULL,
    key_id        text NOT NULL,
    tenant_key_id text NOT NULL,
    wrapped       bytea,
    created_at    timestamptz NOT NULL DEFAULT now(),
    destroyed_at  timestamptz,
    PRIMARY KEY (tenant_id, user_id),
    UNIQUE (tenant_id, key_id)
) PARTITION BY LIST (tenant_id);

CREATE TABLE keystore.team_keys (
    tenant_id     text NOT NULL,
    team_id       text NOT NULL,
    key_id        text NOT NULL,
    tenant_key_id text NOT NULL,
    wrapped       bytea,
    created_at    timestamptz NOT NULL DEFAULT now(),
    destroyed_at  timestamptz,
    PRIMARY KEY (tenant_id, team_id),
    UNIQUE (tenant_id, key_id)
) PARTITION BY LIST (tenant_id);

CREATE TABLE keystore.tenant_keys (
    tenant_id    text PRIMARY KEY,
    key_id       text NOT NULL,
    wrapped      bytea,
    provider     text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    destroyed_at timestamptz,
    UNIQUE (tenant_id, key_id)
) PARTITION BY LIST (tenant_id);

-- The partitioned tables, in the order a tenant's partitions are made (lib/memories/table_partitions.py has the
-- same list, and a test holds them equal).
CREATE FUNCTION memory.partitioned_tables() RETURNS regclass[] LANGUAGE sql STABLE AS $$
    SELECT ARRAY['memory.memory_versions', 'derived.keyword_postings', 'derived.summaries',
                 'derived.prompt_snapshots', 'keystore.subject_keys', 'keystore.team_keys',
                 'keystore.tenant_keys']::regclass[]
$$;

-- A tenant's one-value list bound exactly as pg_get_expr prints it (ruleutils' simple_quote_literal:
-- quotes doubled, backslashes too when standard_conforming_strings is off, never E'...').
CREATE FUNCTION memory.tenant_bound(tenant text) RETURNS text LANGUAGE sql STABLE STRICT AS $$
    SELECT 'FOR VALUES IN (''' || replace(
        CASE current_setting('standard_conforming_strings')
            WHEN 'off' THEN replace(tenant, chr(92), chr(92) || chr(92)) ELSE tenant END,
        '''', '''''') || ''')'
$$;

-- The name a tenant's partition of `parent` starts with: `<table>__t_<16 hex of md5(tenant)>`, 35
-- bytes at most whatever the tenant id (identifiers stop at 63). A collision takes `_2`, `_3`...
CREATE FUNCTION memory.partition_base(parent regclass, tenant text) RETURNS text LANGUAGE sql STABLE STRICT AS $$
    SELECT c.relname || '__t_' || left(md5(tenant), 16) FROM pg_catalog.pg_class c WHERE c.oid = parent
$$;

-- The tenant's partition of `parent`, or NULL. The partition bound decides; the name only narrows
-- the search (deparsing every bound costs ~25 us a partition). `thorough` also finds a partition
-- renamed by hand (a scan of every bound). Bounds are deparsed without their relation (relid 0:
-- a bound names no column), so a lookup never waits for a partition that a compaction holds.
CREATE FUNCTION memory.tenant_partition(parent regclass, tenant text, thorough boolean DEFAULT true)
RETURNS regclass LANGUAGE plpgsql STABLE STRICT AS $$
DECLARE
    want text := memory.tenant_bound(tenant);
    base text := memory.partition_base(parent, tenant);
    child oid;
BEGIN
    -- Names from `base` up to `base~` (a suffix is `_N`): a range of pg_class's name index.
    FOR child IN
        SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_inherits i ON i.inhrelid = c.oid
        WHERE c.relname >= base::name AND c.relname < (base || '~')::name AND i.inhparent = parent
    LOOP
        IF (SELECT pg_catalog.pg_get_expr(c.relpartbound, 0) FROM pg_catalog.pg_class c WHERE c.oid = child)
           = want THEN
            RETURN child::regclass;
        END IF;
    END LOOP;
    IF thorough THEN
        SELECT i.inhrelid INTO child FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = parent AND pg_catalog.pg_get_expr(c.relpartbound, 0) = want;
        RETURN child::regclass;
    END IF;
    RETURN NULL;
END $$;

-- Makes the tenant's missing partitions (idempotent); returns how many it made. A plain table is
-- attached rather than created PARTITION OF: ATTACH takes SHARE UPDATE EXCLUSIVE on the parent,
-- which no read or write waits for, where PARTITION OF takes ACCESS EXCLUSIVE.
CREATE FUNCTION memory.ensure_tenant_partitions(tenant text) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    parent regclass;
    part_schema text;
    parent_name text;
    base text;
    part_name text;
    suffix integer;
    made integer := 0;
BEGIN
    IF tenant IS NULL THEN
        RAISE EXCEPTION 'a tenant id is required to make its partitions';
    END IF;
    FOREACH parent IN ARRAY memory.partitioned_tables() LOOP
        CONTINUE WHEN memory.tenant_partition(parent, tenant, false) IS NOT NULL;
        SELECT n.nspname, c.relname INTO part_schema, parent_name
        FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = parent;
        -- Serialises makers of one parent's partitions; the second finds the first's on re-checking.
        EXECUTE format('LOCK TABLE %I.%I IN SHARE UPDATE EXCLUSIVE MODE', part_schema, parent_name);
        CONTINUE WHEN memory.tenant_partition(parent, tenant, false) IS NOT NULL;
        base := memory.partition_base(parent, tenant);
        part_name := base;
        suffix := 1;
        WHILE to_regclass(format('%I.%I', part_schema, part_name)) IS NOT NULL LOOP
            suffix := suffix + 1;
            part_name := base || '_' || suffix;
        END LOOP;
        EXECUTE format(
            'CREATE TABLE %I.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE'
            ' INCLUDING COMPRESSION)', part_schema, part_name, part_schema, parent_name);
        -- Fails ("would overlap partition") if the tenant has a partition under a foreign name.
        EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES IN (%L)',
                       part_schema, parent_name, part_schema, part_name, tenant);
        made := made + 1;
    END LOOP;
    RETURN made;
END $$;

CREATE FUNCTION memory.tenant_partitions_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM memory.ensure_tenant_partitions(NEW.tenant_id);
    RETURN NULL;
END $$;
-- Created with the tenant, in its transaction: a rolled-back tenant leaves no partitions behind.
CREATE TRIGGER tenants_make_partitions AFTER INSERT ON memory.tenants
    FOR EACH ROW EXECUTE FUNCTION memory.tenant_partitions_trigger();

-- Partitions for every tenant there is, and for tenant ids found only in the old rows.
SELECT memory.ensure_tenant_partitions(t.tenant_id)
FROM (
    SELECT tenant_id FROM memory.tenants
    UNION SELECT tenant_id FROM memory.memory_versions_pre0011
    UNION SELECT tenant_id FROM derived.keyword_postings_pre0011
    UNION SELECT tenant_id FROM derived.summaries_pre0011
    UNION SELECT tenant_id FROM derived.prompt_snapshots_pre0011
    UNION SELECT tenant_id FROM keystore.subject_keys_pre0011
    UNION SELECT tenant_id FROM keystore.team_keys_pre0011
    UNION SELECT tenant_id FROM keystore.tenant_keys_pre0011
) t
ORDER BY t.tenant_id;

INSERT INTO memory.memory_versions (tenant_id, memory_id, version, shareable, category, confidence, text_ct,
    text_mac, original_query_ct, key_id, restored_from, created_at, superseded_at)
SELECT tenant_id, memory_id, version, shareable, category, confidence, text_ct,
    text_mac, original_query_ct, key_id, restored_from, created_at, superseded_at
FROM memory.memory_versions_pre0011;
INSERT INTO derived.keyword_postings (tenant_id, token_mac, memory_id, version)
SELECT tenant_id, token_mac, memory_id, version FROM derived.keyword_postings_pre0011;
INSERT INTO derived.summaries (tenant_id, scope, scope_id, mode, summary_ct, key_id, sources_hash, source_count,
    summarizer, created_at)
SELECT tenant_id, scope, scope_id, mode, summary_ct, key_id, sources_hash, source_count, summarizer, created_at
FROM derived.summaries_pre0011;
INSERT INTO derived.prompt_snapshots (tenant_id, snapshot_id, run_id, subject_id, prompt_ct, key_id, created_at)
SELECT tenant_id, snapshot_id, run_id, subject_id, prompt_ct, key_id, created_at FROM derived.prompt_snapshots_pre0011;
INSERT INTO keystore.subject_keys (tenant_id, user_id, key_id, tenant_key_id, wrapped, created_at, destroyed_at)
SELECT tenant_id, user_id, key_id, tenant_key_id, wrapped, created_at, destroyed_at FROM keystore.subject_keys_pre0011;
INSERT INTO keystore.team_keys (tenant_id, team_id, key_id, tenant_key_id, wrapped, created_at, destroyed_at)
SELECT tenant_id, team_id, key_id, tenant_key_id, wrapped, created_at, destroyed_at FROM keystore.team_keys_pre0011;
INSERT INTO keystore.tenant_keys (tenant_id, key_id, wrapped, provider, created_at, destroyed_at)
SELECT tenant_id, key_id, wrapped, provider, created_at, destroyed_at FROM keystore.tenant_keys_pre0011;

DROP TABLE memory.memory_versions_pre0011, derived.keyword_postings_pre0011, derived.summaries_pre0011,
    derived.prompt_snapshots_pre0011, keystore.subject_keys_pre0011, keystore.team_keys_pre0011,
    keystore.tenant_keys_pre0011;

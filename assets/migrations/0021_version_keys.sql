-- Every deletion destroys a key (issue 32). A memory version's text and original query are sealed
-- under a key of that version alone (keystore.version_keys), wrapped by a group key of its author
-- (keystore.group_keys, at most lib/memories/version_keys.py's GROUP_SIZE versions each), which the
-- tenant's KEK wraps like every other key of the tenant. Forgetting a version deletes its key and
-- marks its group; the physical erasure gives the group's survivors a new group key, deletes the old
-- one, then rotates the KEK. A copy of the forgotten ciphertext anywhere PostgreSQL keeps one (WAL,
-- pg_statistic, a replica, an archive, a backup) is then sealed under a key no key left can rebuild.
CREATE TABLE keystore.group_keys (
    tenant_id  text NOT NULL,
    key_id     text NOT NULL,
    user_id    text NOT NULL,
    wrapped    bytea NOT NULL,
    kek_id     text,
    -- A member's key was destroyed: the next erasure gives the survivors a new group key.
    rekey      boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tenant_id, key_id)
) PARTITION BY LIST (tenant_id);
CREATE INDEX group_keys_by_user ON keystore.group_keys (tenant_id, user_id, created_at);

CREATE TABLE keystore.version_keys (
    tenant_id    text NOT NULL,
    key_id       text NOT NULL,
    group_key_id text NOT NULL,
    memory_id    text NOT NULL,
    version      integer NOT NULL,
    wrapped      bytea NOT NULL,
    PRIMARY KEY (tenant_id, key_id)
) PARTITION BY LIST (tenant_id);
CREATE INDEX version_keys_by_group ON keystore.version_keys (tenant_id, group_key_id);
CREATE INDEX version_keys_by_version ON keystore.version_keys (tenant_id, memory_id, version);

-- Subject keys made before this migration sealed memory texts. Such a key must go once the texts are
-- sealed under version keys (lib/memories/key_conversion.py), but backups taken before that still
-- hold texts sealed under it: it waits here, opening those alone, until every such backup has
-- expired (`destroy_after`), and is then destroyed.
ALTER TABLE keystore.subject_keys ADD COLUMN seals_text boolean NOT NULL DEFAULT true;
ALTER TABLE keystore.subject_keys ALTER COLUMN seals_text SET DEFAULT false;
-- Versions still sealed under a subject key: the conversion's work list, empty once it is done.
CREATE INDEX memory_versions_legacy_sealed ON memory.memory_versions (tenant_id, memory_id, version)
    WHERE key_id NOT LIKE 'vk\_%';
CREATE TABLE keystore.retired_keys (
    tenant_id     text NOT NULL,
    key_id        text NOT NULL,
    user_id       text NOT NULL,
    wrapped       bytea NOT NULL,
    kek_id        text,
    retired_at    timestamptz NOT NULL DEFAULT now(),
    destroy_after timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, key_id)
) PARTITION BY LIST (tenant_id);

CREATE OR REPLACE FUNCTION memory.partitioned_tables() RETURNS regclass[] LANGUAGE sql STABLE AS $$
    SELECT ARRAY['memory.memory_versions', 'derived.keyword_postings', 'derived.summaries',
                 'derived.prompt_snapshots', 'keystore.subject_keys', 'keystore.team_keys',
                 'keystore.tenant_keys', 'keystore.build_keys', 'keystore.group_keys',
                 'keystore.version_keys', 'keystore.retired_keys']::regclass[]
$$;

-- ANALYZE samples up to 101 values of every column into pg_statistic, ciphertexts, MACs and wrapped
-- keys included, where no rewrite of the table reaches them. So no bytea column of ours keeps a
-- sampled value: its statistics target is 0 (ANALYZE leaves it alone), what ANALYZE took before is
-- cleared, and what the planner needs of it (the fraction of NULLs, the average width, how many
-- distinct values: a text MAC is nearly unique, a token MAC repeats) is measured here on a sample and
-- restored without any value (pg_restore_attribute_stats: no most-common values, no histogram).
-- Without it the planner would guess 0.5% of the rows per value looked up, and a bulk write's lookup
-- of 2,000 text MACs scanned the whole partition. A partitioned parent's own (inherited) statistics
-- are cleared only: queries bound to a tenant are planned on its partition. Returns the columns.
CREATE FUNCTION memory.sealed_column_statistics(rel regclass) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    col record;
    kind "char";
    sample text;
    seen bigint;
    nonnull bigint;
    different bigint;
    width numeric;
    columns integer := 0;
BEGIN
    SELECT c.relkind INTO kind FROM pg_catalog.pg_class c WHERE c.oid = rel;
    -- About 30,000 rows, as ANALYZE reads by default; the whole table when it is smaller.
    SELECT CASE WHEN c.reltuples > 30000
                THEN format(' TABLESAMPLE SYSTEM (%s) REPEATABLE (0)', round((3000000 / c.reltuples)::numeric, 4))
                ELSE '' END
      INTO sample FROM pg_catalog.pg_class c WHERE c.oid = rel;
    FOR col IN
        SELECT n.nspname, c.relname, a.attname, a.attstattarget
        FROM pg_catalog.pg_attribute a
        JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE a.attrelid = rel AND a.atttypid = 'bytea'::regtype AND a.attnum > 0 AND NOT a.attisdropped
    LOOP
        IF col.attstattarget IS DISTINCT FROM 0 THEN
            EXECUTE format('ALTER TABLE %I.%I ALTER COLUMN %I SET STATISTICS 0', col.nspname, col.relname, col.attname);
        END IF;
        PERFORM pg_catalog.pg_clear_attribute_stats(col.nspname, col.relname, col.attname, false);
        PERFORM pg_catalog.pg_clear_attribute_stats(col.nspname, col.relname, col.attname, true);
        columns := columns + 1;
        CONTINUE WHEN kind = 'p';
        EXECUTE format('SELECT count(*), count(%1$I), count(DISTINCT %1$I), avg(octet_length(%1$I)) FROM %2$I.%3$I%4$s',
                       col.attname, col.nspname, col.relname, sample)
            INTO seen, nonnull, different, width;
        -- Nothing to measure yet (a new partition): the planner's defaults, until the next call.
        CONTINUE WHEN nonnull = 0;
        PERFORM pg_catalog.pg_restore_attribute_stats(
            'schemaname', col.nspname::text, 'relname', col.relname::text, 'attname', col.attname::text,
            'inherited', false,
            'null_frac', ((seen - nonnull)::real / seen)::real,
            'avg_width', coalesce(round(width), 32)::integer,
            -- As a fraction of the rows (negative), so it follows the table's growth; all distinct: unique.
            'n_distinct', (CASE WHEN different::real / nonnull > 0.9 THEN -1
                                ELSE -(different::real / nonnull) END)::real);
    END LOOP;
    RETURN columns;
END $$;

-- The same body as migration 0011's, and a new tenant's partitions get no statistics of sealed columns
-- (a partition made with LIKE or PARTITION OF does not inherit its parent's statistics targets).
CREATE OR REPLACE FUNCTION memory.ensure_tenant_partitions(tenant text) RETURNS integer LANGUAGE plpgsql AS $$
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
        PERFORM memory.sealed_column_statistics(format('%I.%I', part_schema, part_name)::regclass);
        -- Fails ("would overlap partition") if the tenant has a partition under a foreign name.
        EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES IN (%L)',
                       part_schema, parent_name, part_schema, part_name, tenant);
        made := made + 1;
    END LOOP;
    RETURN made;
END $$;

-- The new partitions for every tenant that has partitions (an offboarded tenant's were dropped).
SELECT memory.ensure_tenant_partitions(t.tenant_id)
FROM memory.tenants t
WHERE memory.tenant_partition('memory.memory_versions'::regclass, t.tenant_id) IS NOT NULL
ORDER BY t.tenant_id;

-- Every table of ours, partitions included: no sampled value of a sealed column, none left behind.
SELECT memory.sealed_column_statistics(c.oid)
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname IN ('memory', 'derived', 'keystore', 'control') AND c.relkind IN ('r', 'p')
ORDER BY c.oid;

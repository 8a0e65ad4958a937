-- Copies in PostgreSQL's history (WAL, dead tuples, replicas) must be useless (issue 20, item 3).
-- Every key a tenant's rows hold is wrapped by the tenant's key-encryption key (KEK), which lives in
-- the key vault outside PostgreSQL (lib/memories/key_vault.py) and which the physical erasure rotates.
-- `kek_id` names the KEK that wraps a row. NULL marks a row wrapped before key vaults: a tenant key
-- wrapped by the master key, other keys wrapped by the tenant key. Such rows still open, and the
-- tenant's first rotation rewraps them under a KEK.
ALTER TABLE keystore.tenant_keys ADD COLUMN kek_id text;
ALTER TABLE keystore.subject_keys ADD COLUMN kek_id text;
ALTER TABLE keystore.team_keys ADD COLUMN kek_id text;

-- One fresh key per build of derived text (a subject or team summary, a prompt snapshot). The row it
-- seals is its only user: the next build's row replaces it, and the trigger below deletes the old key
-- in that very transaction, so an old summary left in WAL or a dead tuple is sealed under a key that
-- is gone (and whose wrapped copies the next KEK rotation makes useless).
CREATE TABLE keystore.build_keys (
    tenant_id  text NOT NULL,
    key_id     text NOT NULL,
    purpose    text NOT NULL CHECK (purpose IN ('summary', 'prompt-snapshot')),
    wrapped    bytea NOT NULL,
    kek_id     text,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, key_id)
) PARTITION BY LIST (tenant_id);

-- The partitioned tables, in the order a tenant's partitions are made (lib/memories/table_partitions.py has the
-- same list, and a test holds them equal).
CREATE OR REPLACE FUNCTION memory.partitioned_tables() RETURNS regclass[] LANGUAGE sql STABLE AS $$
    SELECT ARRAY['memory.memory_versions', 'derived.keyword_postings', 'derived.summaries',
                 'derived.prompt_snapshots', 'keystore.subject_keys', 'keystore.team_keys',
                 'keystore.tenant_keys', 'keystore.build_keys']::regclass[]
$$;

-- The new partition for every tenant that has partitions (an offboarded tenant's were dropped).
SELECT memory.ensure_tenant_partitions(t.tenant_id)
FROM memory.tenants t
WHERE memory.tenant_partition('memory.memory_versions'::regclass, t.tenant_id) IS NOT NULL
ORDER BY t.tenant_id;

-- Whoever replaces or deletes a summary or a prompt snapshot (a rebuild, a cascade, a restore)
-- destroys its build key in the same transaction. EXECUTE plans with the tenant known, so the delete
-- prunes to the tenant's partition (a cached generic plan would lock every tenant's).
CREATE FUNCTION keystore.drop_replaced_build_key() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' OR NEW.key_id IS DISTINCT FROM OLD.key_id THEN
        EXECUTE 'DELETE FROM keystore.build_keys WHERE tenant_id = $1 AND key_id = $2'
            USING OLD.tenant_id, OLD.key_id;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER summaries_drop_build_key AFTER UPDATE OF key_id OR DELETE ON derived.summaries
    FOR EACH ROW EXECUTE FUNCTION keystore.drop_replaced_build_key();
CREATE TRIGGER prompt_snapshots_drop_build_key AFTER UPDATE OF key_id OR DELETE ON derived.prompt_snapshots
    FOR EACH ROW EXECUTE FUNCTION keystore.drop_replaced_build_key();

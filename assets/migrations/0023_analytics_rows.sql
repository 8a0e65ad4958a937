-- The analytics copy lives in PostgreSQL (issue 35, docs/analytics-location.md): every host of a
-- deployment reaches it, and forgetting it is the mechanism that already forgets the primary rows
-- (rows deleted, the tenant's partition rewritten by the erasure, its files byte-scanned). Before,
-- it was Parquet under HOME/analytics, which a run pod of its own takes with it when it ends.
-- No text (its length only), authors and teams pseudonymised under a key of the tenant, no
-- do-not-sell memory. One LIST partition per tenant, as every table holding a tenant's data.
-- gate: forgetting deletes the analytics copy from derived.analytics_rows; older code keeps it in files under HOME and would leave these rows behind
CREATE TABLE derived.analytics_rows (
    tenant_id          text NOT NULL,
    memory_id          text NOT NULL,
    version            integer NOT NULL,
    user_pseudonym     text,
    team_pseudonym     text,
    memory_type        text,
    category           text,
    shareable          boolean,
    confidence         double precision,
    text_length        integer,
    created_at         timestamptz,
    updated_at         timestamptz,
    version_created_at timestamptz,
    PRIMARY KEY (tenant_id, memory_id, version)
) PARTITION BY LIST (tenant_id);

-- Which tenants' copies were built: a tenant never materialized is told so, not shown an empty copy.
CREATE TABLE derived.analytics_tenants (
    tenant_id  text PRIMARY KEY,
    rebuilt_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE OR REPLACE FUNCTION memory.partitioned_tables() RETURNS regclass[] LANGUAGE sql STABLE AS $$
    SELECT ARRAY['memory.memory_versions', 'derived.keyword_postings', 'derived.summaries',
                 'derived.prompt_snapshots', 'derived.analytics_rows', 'keystore.subject_keys',
                 'keystore.team_keys', 'keystore.tenant_keys', 'keystore.build_keys',
                 'keystore.group_keys', 'keystore.version_keys', 'keystore.retired_keys']::regclass[]
$$;

-- The new partition for every tenant that has partitions (an offboarded tenant's were dropped).
SELECT memory.ensure_tenant_partitions(t.tenant_id)
FROM memory.tenants t
WHERE memory.tenant_partition('memory.memory_versions'::regclass, t.tenant_id) IS NOT NULL
ORDER BY t.tenant_id;

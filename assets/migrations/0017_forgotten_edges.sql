-- Tombstones found by their job: analytics reads hide those of open jobs, and a retention sweep's
-- acceptance reads back what it tombstoned (both scanned a tenant's every tombstone before).
CREATE INDEX IF NOT EXISTS tombstones_by_job ON control.tombstones (job_id);

-- A cached recall names the user who asked: a SUBJECT forget removes every answer to that user's own
-- queries, whatever memories (or none) it names. Entries from before name no one; a cache refills.
ALTER TABLE derived.recall_cache ADD COLUMN user_id text;
DELETE FROM derived.lineage WHERE store = 'recall_cache';
DELETE FROM derived.recall_cache;
CREATE INDEX recall_cache_by_user ON derived.recall_cache (tenant_id, user_id);

-- A request made by a Dagster run (a launchpad forget), keyed by the run's root run: re-executing the
-- run finds the job the root run created instead of accepting the request a second time.
CREATE TABLE control.deletion_request_keys (
    tenant_id   text NOT NULL,
    request_key text NOT NULL,
    job_id      text NOT NULL REFERENCES control.deletion_jobs (job_id),
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, request_key)
);

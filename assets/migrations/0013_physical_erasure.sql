-- Physical erasure leaves the cascade: a COMPLETE deletion waits (until erasure_deadline) for the
-- tenant's erasure run, which rewrites the files and proves with a byte scan that none holds it.
ALTER TABLE control.deletion_jobs
    ADD COLUMN erasure_deadline timestamptz,
    ADD COLUMN erased_at timestamptz,
    ADD COLUMN erasure jsonb;

-- Jobs completed before this release were compacted inside their cascade.
UPDATE control.deletion_jobs SET erased_at = completed_at WHERE state = 'COMPLETE';

CREATE INDEX deletion_jobs_erasure_pending ON control.deletion_jobs (tenant_id, erasure_deadline)
    WHERE state = 'COMPLETE' AND erased_at IS NULL;

-- Keyed 64-bit fingerprints of 16-byte windows of what a job deleted (never the bytes): the erasure's
-- byte scan looks for them, then drops them.
CREATE TABLE control.erasure_fingerprints (
    job_id      text NOT NULL REFERENCES control.deletion_jobs (job_id),
    store       text NOT NULL,
    fingerprint bigint NOT NULL,
    PRIMARY KEY (job_id, store, fingerprint)
);

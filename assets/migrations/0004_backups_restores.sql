-- Backups, restores and the restore gate. Rows hold ids, counts and wrapped keys, never content.

-- Restore gate: while set, every read and write of the tenant is refused.
ALTER TABLE memory.tenants ADD COLUMN restoring_since timestamptz;

CREATE TABLE control.backups (
    backup_id     text PRIMARY KEY,
    tenant_id     text NOT NULL,
    location      text NOT NULL,
    object_key    text NOT NULL,
    manifest      jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL,
    expired_at    timestamptz
);
CREATE INDEX backups_by_tenant ON control.backups (tenant_id, created_at);

CREATE TABLE control.restores (
    restore_id   text PRIMARY KEY,
    tenant_id    text NOT NULL,
    backup_id    text NOT NULL REFERENCES control.backups (backup_id),
    state        text NOT NULL CHECK (state IN ('REQUESTED', 'RUNNING', 'COMPLETE', 'BLOCKED')),
    report       jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz
);
CREATE INDEX restores_by_state ON control.restores (state, completed_at);

-- Retention sweeps delete by policy; their jobs are scope RETENTION (a fixed set of memories).
ALTER TABLE control.deletion_jobs DROP CONSTRAINT deletion_jobs_scope_check;
ALTER TABLE control.deletion_jobs ADD CONSTRAINT deletion_jobs_scope_check
    CHECK (scope IN ('SUBJECT', 'MEMORY', 'TENANT', 'RETENTION'));
ALTER TABLE control.deletion_jobs ADD COLUMN sweep_date date;
-- Counts by category for a retention sweep's proof (no ids, no content).
ALTER TABLE control.deletion_jobs ADD COLUMN detail jsonb NOT NULL DEFAULT '{}'::jsonb;

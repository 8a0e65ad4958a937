-- Deletion control plane: jobs, tombstones, the append-only journal, audit and outbox.
-- Nothing here holds memory text: scopes are ids, the proof carries an HMAC of the scope and counts.
CREATE SCHEMA IF NOT EXISTS control;

-- Hide at once: set when a request is accepted, before any store is touched.
ALTER TABLE memory.subjects ADD COLUMN forgotten_at timestamptz;
ALTER TABLE memory.tenants ADD COLUMN deleted_at timestamptz;

CREATE TABLE control.deletion_jobs (
    job_id           text PRIMARY KEY,
    tenant_id        text NOT NULL,
    scope            text NOT NULL CHECK (scope IN ('SUBJECT', 'MEMORY', 'TENANT')),
    subject_id       text,
    memory_id        text,
    version          integer,
    scope_hash       bytea NOT NULL,
    basis            text NOT NULL,
    policy_version   text NOT NULL,
    state            text NOT NULL CHECK (state IN ('REQUESTED', 'FROZEN', 'DELETING', 'VERIFYING', 'COMPLETE', 'BLOCKED')),
    subject_epoch    bigint,
    deadline         timestamptz NOT NULL,
    targets          jsonb NOT NULL DEFAULT '{}'::jsonb,
    target_count     integer NOT NULL DEFAULT 0,
    targets_fixed    boolean NOT NULL DEFAULT false,
    found            jsonb,
    proof            jsonb,
    attempts         integer NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz
);
-- One open job per scope: a second request returns the open one.
CREATE UNIQUE INDEX deletion_jobs_open_scope ON control.deletion_jobs (tenant_id, scope_hash) WHERE state <> 'COMPLETE';
CREATE INDEX deletion_jobs_by_state ON control.deletion_jobs (state, tenant_id);

-- Exact (memory_id, version) tombstones for MEMORY scope; replayed by every restore.
CREATE TABLE control.tombstones (
    tenant_id  text NOT NULL,
    memory_id  text NOT NULL,
    version    integer NOT NULL,
    job_id     text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, memory_id, version)
);

-- Append-only journal of epochs, tombstones and key destructions (outlives backups).
CREATE TABLE control.journal (
    seq        bigserial PRIMARY KEY,
    tenant_id  text NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('SUBJECT_EPOCH', 'TOMBSTONE', 'TENANT_DELETED', 'KEY_DESTROYED')),
    subject_id text,
    memory_id  text,
    version    integer,
    epoch      bigint,
    key_id     text,
    job_id     text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE FUNCTION control.refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'control.% is append-only', TG_TABLE_NAME;
END $$;
CREATE TRIGGER journal_append_only BEFORE UPDATE OR DELETE ON control.journal
    FOR EACH ROW EXECUTE FUNCTION control.refuse_change();

CREATE TABLE control.audit (
    seq        bigserial PRIMARY KEY,
    job_id     text NOT NULL,
    tenant_id  text NOT NULL,
    event      text NOT NULL,
    state      text,
    detail     jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TRIGGER audit_append_only BEFORE UPDATE OR DELETE ON control.audit
    FOR EACH ROW EXECUTE FUNCTION control.refuse_change();

CREATE TABLE control.outbox (
    seq          bigserial PRIMARY KEY,
    job_id       text NOT NULL,
    tenant_id    text NOT NULL,
    kind         text NOT NULL,
    payload      jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz
);

-- The control-plane key (scope HMACs) is never shredded: it lives apart from tenant keys.
CREATE TABLE keystore.control_key (
    id         integer PRIMARY KEY CHECK (id = 1),
    wrapped    bytea NOT NULL,
    provider   text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The exact (memory_id, version) pairs a job covers, fixed when it first runs (ids only).
CREATE TABLE control.deletion_targets (
    job_id    text NOT NULL REFERENCES control.deletion_jobs (job_id),
    memory_id text NOT NULL,
    version   integer NOT NULL,
    PRIMARY KEY (job_id, memory_id, version)
);

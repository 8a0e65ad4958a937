-- Fencing in-flight agent runs: leases, the fences they read, permits, and fence closures.
-- One sequence orders permits and closures, so an audit can prove no permit followed a closure.
CREATE SEQUENCE control.gate_seq;

CREATE TABLE control.leases (
    lease_id    text PRIMARY KEY,
    tenant_id   text NOT NULL,
    subject_id  text NOT NULL,           -- the user the run acts for
    run_id      text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    closed_at   timestamptz
);
CREATE INDEX leases_by_run ON control.leases (tenant_id, run_id);

-- What a run read: the exact version, and its author's epoch at the moment of reading.
CREATE TABLE control.lease_fences (
    lease_id   text NOT NULL REFERENCES control.leases (lease_id),
    tenant_id  text NOT NULL,
    memory_id  text NOT NULL,
    version    integer NOT NULL,
    author_id  text NOT NULL,
    epoch      bigint NOT NULL,
    read_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (lease_id, memory_id, version)
);
CREATE INDEX lease_fences_by_author ON control.lease_fences (tenant_id, author_id);
CREATE INDEX lease_fences_by_version ON control.lease_fences (tenant_id, memory_id, version);

CREATE TABLE control.permits (
    permit_id        text PRIMARY KEY,
    seq              bigint NOT NULL DEFAULT nextval('control.gate_seq'),
    lease_id         text NOT NULL REFERENCES control.leases (lease_id),
    tenant_id        text NOT NULL,
    sink             text NOT NULL,
    state            text NOT NULL CHECK (state IN ('IN_FLIGHT', 'RELEASED', 'CANCELLED')),
    cancel_requested boolean NOT NULL DEFAULT false,
    issued_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at         timestamptz
);
CREATE INDEX permits_in_flight ON control.permits (tenant_id, lease_id) WHERE state = 'IN_FLIGHT';

-- A deletion's acceptance closes fences: a subject's epochs below `epoch`, or exact versions.
CREATE TABLE control.fence_closures (
    seq        bigint PRIMARY KEY DEFAULT nextval('control.gate_seq'),
    tenant_id  text NOT NULL,
    job_id     text NOT NULL,
    subject_id text,
    epoch      bigint,
    memory_id  text,
    version    integer,
    closed_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX fence_closures_by_job ON control.fence_closures (job_id);

-- Prompt snapshots: the prompt a run sent, sealed under the run subject's key; a registered store.
CREATE TABLE derived.prompt_snapshots (
    tenant_id   text NOT NULL,
    snapshot_id text NOT NULL,
    run_id      text NOT NULL,
    subject_id  text NOT NULL,
    prompt_ct   bytea NOT NULL,
    key_id      text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, snapshot_id)
);
CREATE INDEX prompt_snapshots_by_run ON derived.prompt_snapshots (tenant_id, run_id);

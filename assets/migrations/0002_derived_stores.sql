-- Derived stores kept in PostgreSQL, and the derivedFrom lineage of every derived record.
CREATE SCHEMA IF NOT EXISTS derived;

-- Subject epoch: bumped by SUBJECT-scope deletion; derived records carry the epoch they read.
ALTER TABLE memory.subjects ADD COLUMN epoch bigint NOT NULL DEFAULT 0;

-- derivedFrom edges: one row per (derived record, source memory version). Deletion walks these.
CREATE TABLE derived.lineage (
    tenant_id        text NOT NULL,
    store            text NOT NULL,
    record_id        text NOT NULL,
    source_memory_id text NOT NULL,
    source_version   integer NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, store, record_id, source_memory_id, source_version)
);
CREATE INDEX lineage_by_source ON derived.lineage (tenant_id, source_memory_id, source_version);

-- Blind keyword index: HMAC(tenant keyword key, normalised token); no plaintext token at rest.
CREATE TABLE derived.keyword_postings (
    tenant_id text NOT NULL,
    token_mac bytea NOT NULL,
    memory_id text NOT NULL,
    version   integer NOT NULL,
    PRIMARY KEY (tenant_id, token_mac, memory_id, version)
);
CREATE INDEX keyword_postings_by_memory ON derived.keyword_postings (tenant_id, memory_id, version);

-- Summaries per subject and per team: ciphertext under the subject key or the team key.
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
);

CREATE TABLE derived.summary_modes (
    tenant_id text NOT NULL,
    user_id   text NOT NULL,
    mode      text NOT NULL CHECK (mode IN ('full', 'summary', 'hybrid')),
    PRIMARY KEY (tenant_id, user_id)
);

-- Recall cache: ids and versions only, keyed by an HMAC of the query and its scope.
CREATE TABLE derived.recall_cache (
    tenant_id  text NOT NULL,
    cache_key  bytea NOT NULL,
    change_seq bigint NOT NULL,
    results    jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, cache_key)
);

CREATE TABLE keystore.team_keys (
    tenant_id     text NOT NULL,
    team_id       text NOT NULL,
    key_id        text NOT NULL UNIQUE,
    tenant_key_id text NOT NULL,
    wrapped       bytea,
    created_at    timestamptz NOT NULL DEFAULT now(),
    destroyed_at  timestamptz,
    PRIMARY KEY (tenant_id, team_id)
);

-- Versioned memory store and key store. Memory text exists here only as AES-256-GCM ciphertext.
CREATE SCHEMA IF NOT EXISTS memory;
CREATE SCHEMA IF NOT EXISTS keystore;

CREATE TABLE memory.tenants (
    tenant_id    text PRIMARY KEY,
    sharing_mode text NOT NULL DEFAULT 'strict'
                 CHECK (sharing_mode IN ('strict', 'shared_pool', 'progressive')),
    change_seq   bigint NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE memory.subjects (
    tenant_id   text NOT NULL REFERENCES memory.tenants (tenant_id),
    user_id     text NOT NULL,
    do_not_sell boolean NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, user_id)
);

CREATE TABLE memory.teams (
    tenant_id  text NOT NULL REFERENCES memory.tenants (tenant_id),
    team_id    text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, team_id)
);

CREATE TABLE memory.team_members (
    tenant_id text NOT NULL,
    team_id   text NOT NULL,
    user_id   text NOT NULL,
    added_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, team_id, user_id),
    FOREIGN KEY (tenant_id, team_id) REFERENCES memory.teams (tenant_id, team_id),
    FOREIGN KEY (tenant_id, user_id) REFERENCES memory.subjects (tenant_id, user_id)
);
CREATE INDEX team_members_by_user ON memory.team_members (tenant_id, user_id);

-- One row per memory: its owner (the subject), its team, and which version is current.
CREATE TABLE memory.memories (
    tenant_id       text NOT NULL,
    memory_id       text NOT NULL,
    user_id         text NOT NULL,
    team_id         text,
    memory_type     text NOT NULL CHECK (memory_type IN ('personal', 'team_shared')),
    current_version integer NOT NULL,
    do_not_sell     boolean NOT NULL DEFAULT false,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, memory_id),
    CHECK ((team_id IS NULL) = (memory_type = 'personal')),
    FOREIGN KEY (tenant_id, user_id) REFERENCES memory.subjects (tenant_id, user_id),
    FOREIGN KEY (tenant_id, team_id) REFERENCES memory.teams (tenant_id, team_id)
);
CREATE INDEX memories_by_owner ON memory.memories (tenant_id, user_id, team_id);
CREATE INDEX memories_by_team ON memory.memories (tenant_id, team_id) WHERE team_id IS NOT NULL;

-- Every version ever written; history is appended to, never rewritten.
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
);
-- Finds a subject's current memory with identical text (the no-op rule) without decrypting.
CREATE INDEX memory_versions_current_mac ON memory.memory_versions (tenant_id, text_mac) WHERE superseded_at IS NULL;

CREATE TABLE keystore.tenant_keys (
    tenant_id    text PRIMARY KEY,
    key_id       text NOT NULL UNIQUE,
    wrapped      bytea,
    provider     text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    destroyed_at timestamptz
);

CREATE TABLE keystore.subject_keys (
    tenant_id     text NOT NULL,
    user_id       text NOT NULL,
    key_id        text NOT NULL UNIQUE,
    tenant_key_id text NOT NULL,
    wrapped       bytea,
    created_at    timestamptz NOT NULL DEFAULT now(),
    destroyed_at  timestamptz,
    PRIMARY KEY (tenant_id, user_id)
);

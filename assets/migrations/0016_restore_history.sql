-- What a restore owes to the history around a deletion (issue 20): backups counted while in flight,
-- consent and access changes that outlive any backup, restore ids that belong to one restore.

-- A backup is registered before its snapshot is taken, so a proof completing while it uploads counts
-- it. FAILED backups are marked expired at once (their objects are deleted).
ALTER TABLE control.backups
    ADD COLUMN state text NOT NULL DEFAULT 'DONE' CHECK (state IN ('IN_FLIGHT', 'DONE', 'FAILED')),
    ADD COLUMN snapshot_at timestamptz;
ALTER TABLE control.backups ALTER COLUMN manifest SET DEFAULT '{}'::jsonb;

-- Append-only journal of consent and access changes (ids and flags, never content), written in the
-- transaction of each change. A restore replays the entries its backup's snapshot did not see: `xid`
-- is the writing transaction, tested against the snapshot the backup recorded (pg_visible_in_snapshot).
CREATE TABLE control.consent_journal (
    seq        bigserial PRIMARY KEY,
    tenant_id  text NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('MEMORY_DO_NOT_SELL', 'SUBJECT_DO_NOT_SELL', 'TEAM_MEMBER_ADDED',
                                             'TEAM_MEMBER_REMOVED', 'SHARING_MODE')),
    memory_id  text,
    subject_id text,
    team_id    text,
    flag       boolean,
    mode       text,
    xid        xid8 NOT NULL DEFAULT pg_current_xact_id(),
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX consent_journal_by_tenant ON control.consent_journal (tenant_id, seq);
CREATE TRIGGER consent_journal_append_only BEFORE UPDATE OR DELETE ON control.consent_journal
    FOR EACH ROW EXECUTE FUNCTION control.refuse_change();

-- New restore ids have the form the code checks (older rows are left as they are).
ALTER TABLE control.restores ADD CONSTRAINT restores_id_format
    CHECK (restore_id ~ '^r_[a-z0-9][a-z0-9_-]{0,61}$') NOT VALID;

-- Every restore reads the tenant's journal by kind (epochs, forgotten memories, destroyed keys), three
-- times: filtering the staged rows, the safety net and the verification. The journal holds every
-- tenant's entries, and a sequential scan of it per rule grows with the whole platform.
CREATE INDEX IF NOT EXISTS journal_by_tenant_kind ON control.journal (tenant_id, kind);

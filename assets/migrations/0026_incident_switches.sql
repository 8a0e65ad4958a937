-- Incident switches (issue 36): deletion work paused for a tenant or for all, and a store's deletion
-- adapter pinned to a version it ships. Requests are still accepted and hidden while paused; no
-- cascade or erasure starts until `deletion resume`. Deadlines keep running.
-- gate: deletion work paused by an operator (control.deletion_pauses) would be cascaded anyway, and a pinned adapter version ignored
CREATE TABLE control.deletion_pauses (
    pause_id   bigserial PRIMARY KEY,
    tenant_id  text,  -- NULL: every tenant
    reason     text NOT NULL,
    paused_at  timestamptz NOT NULL DEFAULT now(),
    resumed_at timestamptz,
    CHECK (resumed_at IS NULL OR resumed_at >= paused_at)
);
-- One open pause per scope (NULL tenant: the one of every tenant).
CREATE UNIQUE INDEX deletion_pauses_open ON control.deletion_pauses (coalesce(tenant_id, '')) WHERE resumed_at IS NULL;

CREATE TABLE control.adapter_pins (
    store     text PRIMARY KEY,
    version   text NOT NULL,
    reason    text NOT NULL,
    pinned_at timestamptz NOT NULL DEFAULT now()
);

-- No switch, command or statement re-opens a completed deletion: a COMPLETE job stays COMPLETE, its
-- scope stays what it was, and it is never removed.
CREATE FUNCTION control.keep_complete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF OLD.state = 'COMPLETE' THEN
            RAISE EXCEPTION 'deletion job % is COMPLETE: it cannot be removed', OLD.job_id
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN OLD;
    END IF;
    IF OLD.state = 'COMPLETE' AND (NEW.state <> 'COMPLETE' OR NEW.scope_hash <> OLD.scope_hash
            OR NEW.tenant_id <> OLD.tenant_id OR NEW.completed_at IS NULL) THEN
        RAISE EXCEPTION 'deletion job % is COMPLETE: it cannot be re-opened', OLD.job_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER deletion_jobs_keep_complete BEFORE UPDATE OR DELETE ON control.deletion_jobs
    FOR EACH ROW EXECUTE FUNCTION control.keep_complete();

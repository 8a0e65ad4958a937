-- The deletion ledger's sequence: the forget sensor's cursor, and the backoff of BLOCKED jobs.
--
-- `seq` takes a new value from one sequence each time a job becomes REQUESTED or BLOCKED, so
-- "what changed since the sensor last looked" is `seq > cursor`, whatever wrote the row (the CLI,
-- the Python API, a retention sweep, a blocked step). `next_attempt_at` is when a BLOCKED job may
-- be retried: 1 minute after its first attempt, doubling per attempt, capped at 1 hour.
-- A trigger sets both, so no writer can forget to; nothing here holds content.
CREATE SEQUENCE control.deletion_ledger_seq;

ALTER TABLE control.deletion_jobs ADD COLUMN seq bigint;
ALTER TABLE control.deletion_jobs ADD COLUMN next_attempt_at timestamptz;

-- Jobs open before this migration enter the ledger in the order they were requested.
UPDATE control.deletion_jobs j SET seq = o.seq
FROM (
    SELECT job_id, nextval('control.deletion_ledger_seq') AS seq
    FROM (SELECT job_id FROM control.deletion_jobs WHERE state IN ('REQUESTED', 'BLOCKED') ORDER BY created_at) q
) o
WHERE j.job_id = o.job_id;
UPDATE control.deletion_jobs
SET next_attempt_at = updated_at + least(interval '1 hour', interval '1 minute' * power(2, greatest(attempts, 1) - 1))
WHERE state = 'BLOCKED';

CREATE FUNCTION control.deletion_ledger_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IN ('REQUESTED', 'BLOCKED')
       AND (TG_OP = 'INSERT' OR OLD.state IS DISTINCT FROM NEW.state) THEN
        NEW.seq := nextval('control.deletion_ledger_seq');
        IF NEW.state = 'BLOCKED' THEN
            NEW.next_attempt_at := now()
                + least(interval '1 hour', interval '1 minute' * power(2, greatest(NEW.attempts, 1) - 1));
        ELSE
            NEW.next_attempt_at := NULL;
        END IF;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER deletion_jobs_ledger_seq BEFORE INSERT OR UPDATE OF state ON control.deletion_jobs
    FOR EACH ROW EXECUTE FUNCTION control.deletion_ledger_bump();

CREATE INDEX deletion_jobs_open_by_seq ON control.deletion_jobs (seq) WHERE state <> 'COMPLETE';

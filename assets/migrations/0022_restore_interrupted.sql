-- A restore whose process died behind its gate (issue 33): its tenant reopens at the next command that
-- touches it, on the rows it had (the load never committed), and the restore is INTERRUPTED, which a
-- retry of the same restore id may take over like a BLOCKED one.
ALTER TABLE control.restores DROP CONSTRAINT restores_state_check;
ALTER TABLE control.restores ADD CONSTRAINT restores_state_check
    CHECK (state IN ('REQUESTED', 'RUNNING', 'COMPLETE', 'BLOCKED', 'INTERRUPTED'));

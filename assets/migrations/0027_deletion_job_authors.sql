-- A subject's export (issue 36) lists their deletion jobs: a SUBJECT job names them, a MEMORY job now
-- records the memory's author when it is accepted (the memory itself goes with the cascade). The
-- completion of the author's own SUBJECT forget clears it again: the export after it lists nothing.
ALTER TABLE control.deletion_jobs ADD COLUMN author_id text;
UPDATE control.deletion_jobs j SET author_id = m.user_id FROM memory.memories m
    WHERE j.scope = 'MEMORY' AND m.tenant_id = j.tenant_id AND m.memory_id = j.memory_id;

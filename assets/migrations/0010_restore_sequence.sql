-- A commit sequence for restores: a number assigned when a restore becomes COMPLETE. The update
-- takes a transaction lock first (held to commit), so numbers become visible in commit order: once
-- N is visible, no restore numbered below N can still appear. The backfill sensor's cursor is the
-- highest number it acted on; a restore that started earlier but completed later is seen, once.
CREATE SEQUENCE control.restore_completion_seq;
ALTER TABLE control.restores ADD COLUMN completion_seq bigint UNIQUE;

-- A whole memory forgotten is journalled as such, not only as tombstones of the versions it had then:
-- a restore of a backup holding versions of it that no longer existed at the deletion (an earlier
-- restore dropped them) must remove those too.
ALTER TABLE control.journal DROP CONSTRAINT IF EXISTS journal_kind_check;
ALTER TABLE control.journal ADD CONSTRAINT journal_kind_check
    CHECK (kind IN ('SUBJECT_EPOCH', 'TOMBSTONE', 'TENANT_DELETED', 'KEY_DESTROYED', 'MEMORY_FORGOTTEN'));

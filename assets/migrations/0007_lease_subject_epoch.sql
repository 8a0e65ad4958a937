-- A lease is bound to its own subject's epoch too: a run that read nothing still acts for a user,
-- and gets no permit once that user (or the tenant) is being forgotten.
ALTER TABLE control.leases ADD COLUMN subject_epoch bigint;

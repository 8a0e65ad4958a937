-- A store is brought under the hard gate one by one (issue 36): registered `onboarding`, it receives
-- only the memories of tenants marked as test tenants (`memory-pipelines tenant set-test`), then
-- `enforced`, every tenant's. Lineage refuses any other write to it.
ALTER TABLE memory.tenants ADD COLUMN test_tenant boolean NOT NULL DEFAULT false;

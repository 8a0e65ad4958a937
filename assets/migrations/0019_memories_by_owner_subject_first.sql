-- A tenant the statistics of the shared heads table do not know yet is estimated at one row, and
-- then `memories_by_owner (tenant_id, user_id, team_id)` ties with the primary key for a lookup by
-- (tenant_id, memory_id): PostgreSQL took the owner index and filtered the whole tenant for every
-- foreign-key check and point lookup (8,000 bulk-written rows read 30 million index tuples). With
-- the subject first, only a query naming the subject can use it; lookups by id take the key.
DROP INDEX memory.memories_by_owner;
CREATE INDEX memories_by_owner ON memory.memories (user_id, tenant_id, team_id);

-- The blind keyword index MACs the tokens of an author-only version (a personal memory's version not
-- marked shareable: its author alone sees it under every sharing mode) under a key derived from the
-- author's subject key, so no other writer of the tenant can MAC a chosen token the same way and
-- match it (lib/stores/keyword/index.py). Postings written before, under the tenant keyword key, are marked: they
-- stay findable (a personal view's search asks the tenant key too) until the tenant's next keyword
-- sync rewrites them under the author's key and clears the mark. The partial index holds the marked
-- postings alone: a sync asks it for them at a cost that does not grow with the tenant's postings.
ALTER TABLE derived.keyword_postings ADD COLUMN legacy_key boolean NOT NULL DEFAULT false;

UPDATE derived.keyword_postings p SET legacy_key = true
FROM memory.memories m
JOIN memory.memory_versions v ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id
WHERE p.tenant_id = m.tenant_id AND p.memory_id = m.memory_id AND p.version = v.version
    AND m.team_id IS NULL AND NOT v.shareable;

CREATE INDEX keyword_postings_legacy ON derived.keyword_postings (tenant_id, memory_id, version)
    WHERE legacy_key;

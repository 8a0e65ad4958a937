-- A forget finds cached recalls by what they name, not by lineage alone: results @> '[["m_..", 2]]'.
CREATE INDEX recall_cache_results ON derived.recall_cache USING gin (results jsonb_path_ops);

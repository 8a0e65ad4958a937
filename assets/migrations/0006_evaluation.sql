-- Memory quality evaluation: which memory each evaluation-set key became, and monthly results.
-- Ids and figures only.
CREATE TABLE control.eval_keys (
    tenant_id text NOT NULL,
    key       text NOT NULL,
    memory_id text NOT NULL,
    PRIMARY KEY (tenant_id, key)
);

CREATE TABLE control.eval_results (
    tenant_id   text NOT NULL,
    month       date NOT NULL,
    metric      text NOT NULL CHECK (metric IN ('quality', 'drift')),
    mode        text NOT NULL,
    precision   double precision,
    recall      double precision,
    drift       double precision,
    k           integer NOT NULL,
    queries     integer NOT NULL,
    judge       text NOT NULL,
    computed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, month, metric, mode)
);

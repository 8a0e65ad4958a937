-- Memory quality per K (issue 23): each monthly evaluation's precision@K and recall@K per recall
-- mode at K = 1, 5 and 10, beside the set's own K in control.eval_results. Figures only.
CREATE TABLE control.eval_results_at_k (
    tenant_id   text NOT NULL,
    month       date NOT NULL,
    mode        text NOT NULL,
    k           integer NOT NULL CHECK (k BETWEEN 1 AND 100),
    precision   double precision NOT NULL,
    recall      double precision NOT NULL,
    queries     integer NOT NULL,
    judge       text NOT NULL,
    computed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, month, mode, k)
);

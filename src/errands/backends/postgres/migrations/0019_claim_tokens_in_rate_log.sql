-- Version 19: each start a limited claim logs in errands_rate_log carries the claim's
-- lease token, so a claim whose reply was lost (its connection broke once its COMMIT was
-- sent: it may have committed, and the worker never learnt which jobs it took) is given
-- back whole: its jobs, and the starts it counted against their rates (job_claim_undo).
-- Rows logged by earlier releases keep NULL. A nullable column without a default: no
-- table rewrite, the lock is held for an instant.
SET LOCAL lock_timeout = '5s';
ALTER TABLE {schema}.errands_rate_log ADD COLUMN token text;

-- Version 18: each worker records how often it beats (seconds: a third of its shortest
-- lease), so the dashboard, the served-queue checks and the unrunnable-jobs figure judge
-- it by its own heartbeat, not by the lease of whichever App reads the registry: a
-- worker whose app's lease is 300 s beats every 100 s, and a dashboard on the default
-- 30 s lease showed it dead (and its queues unserved) between two beats. Workers of
-- earlier versions leave it NULL: they are judged by the reader's lease, as before.
-- A nullable column without a default: no table rewrite, the lock is held for an instant.
SET LOCAL lock_timeout = '5s';
ALTER TABLE {schema}.errands_workers ADD COLUMN beat_seconds double precision;

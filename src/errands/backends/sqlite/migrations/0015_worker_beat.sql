-- Version 15: each worker records how often it beats (seconds: a third of its shortest
-- lease), so the dashboard, the served-queue checks and the unrunnable-jobs figure judge
-- it by its own heartbeat, not by the lease of whichever App reads the registry: a
-- worker whose app's lease is 300 s beats every 100 s, and a dashboard on the default
-- 30 s lease showed it dead (and its queues unserved) between two beats. Workers of
-- earlier versions leave it NULL: they are judged by the reader's lease, as before.
ALTER TABLE errands_workers ADD COLUMN beat_seconds REAL;

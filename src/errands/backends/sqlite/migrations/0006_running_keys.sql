-- Version 6: running jobs by concurrency key. A limited queue's claim skips the jobs
-- whose key already runs at its limit, counting that key's running jobs per candidate;
-- this index keeps each count to the few running rows of one key.

CREATE INDEX errands_jobs_running_keys
    ON errands_jobs (concurrency_key)
    WHERE state = 'running' AND concurrency_key IS NOT NULL;

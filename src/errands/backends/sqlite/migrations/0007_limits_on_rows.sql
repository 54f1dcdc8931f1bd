-- Version 7: limits travel on the job row.
--
-- A job type's rate (@app.job(rate=...)) is stored on each row it enqueues, beside the
-- concurrency key and limit, so a claim enforces it whatever queue the row is in and
-- whichever worker declared what (rows enqueued before this version take their type's
-- declared rate). errands_jobs_limited finds a queue's due rows that carry a limit; a
-- worker claims such queues through the limited path.
--
-- Also: errands_jobs_running_keys (version 6) repeated errands_jobs_running_key
-- (version 2) and is dropped; each errands_rate_log row keeps its bucket's period, so
-- pruning keeps a bucket's rows for its own window instead of a day.

ALTER TABLE errands_jobs ADD COLUMN rate_limit INTEGER;
ALTER TABLE errands_jobs ADD COLUMN rate_period REAL;

UPDATE errands_jobs
SET rate_limit = (SELECT l.rate_limit FROM errands_job_limits AS l
                  WHERE l.name = errands_jobs.name),
    rate_period = (SELECT l.rate_period FROM errands_job_limits AS l
                   WHERE l.name = errands_jobs.name)
WHERE state IN ('available', 'scheduled', 'retryable', 'running')
  AND name IN (SELECT name FROM errands_job_limits WHERE rate_limit IS NOT NULL);

CREATE INDEX errands_jobs_limited
    ON errands_jobs (queue, name)
    WHERE state IN ('available', 'scheduled', 'retryable')
      AND (concurrency_key IS NOT NULL OR rate_limit IS NOT NULL);

DROP INDEX IF EXISTS errands_jobs_running_keys;

ALTER TABLE errands_rate_log ADD COLUMN period REAL NOT NULL DEFAULT 86400;

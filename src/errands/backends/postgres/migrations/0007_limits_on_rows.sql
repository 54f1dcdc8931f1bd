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

ALTER TABLE {schema}.errands_jobs
    ADD COLUMN rate_limit integer,
    ADD COLUMN rate_period double precision;

UPDATE {schema}.errands_jobs AS j
SET rate_limit = l.rate_limit, rate_period = l.rate_period
FROM {schema}.errands_job_limits AS l
WHERE j.name = l.name AND l.rate_limit IS NOT NULL
  AND j.state IN ('available', 'scheduled', 'retryable', 'running');

CREATE INDEX errands_jobs_limited
    ON {schema}.errands_jobs (queue, name)
    WHERE state IN ('available', 'scheduled', 'retryable')
      AND (concurrency_key IS NOT NULL OR rate_limit IS NOT NULL);

DROP INDEX IF EXISTS {schema}.errands_jobs_running_keys;

ALTER TABLE {schema}.errands_rate_log
    ADD COLUMN period double precision NOT NULL DEFAULT 86400;

-- Version 3: cluster-wide limits. Per-key concurrency limits travel on each job row; job
-- types declare their rate limits in errands_job_limits; every start of a rate-limited
-- queue or job type is logged in errands_rate_log (a sliding window, pruned by the leader).

ALTER TABLE errands_jobs ADD COLUMN concurrency_limit INTEGER;
ALTER TABLE errands_queues ADD COLUMN has_keys INTEGER NOT NULL DEFAULT 0;

CREATE TABLE errands_job_limits (
    name        TEXT PRIMARY KEY,
    queue       TEXT NOT NULL,
    rate_limit  INTEGER,
    rate_period REAL,
    updated_at  REAL NOT NULL
);

CREATE TABLE errands_rate_log (
    bucket TEXT NOT NULL,
    at     REAL NOT NULL
);
CREATE INDEX errands_rate_log_bucket ON errands_rate_log (bucket, at);

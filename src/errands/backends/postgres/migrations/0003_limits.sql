-- Version 3: cluster-wide limits. Per-key concurrency limits travel on each job row; job
-- types declare their rate limits in errands_job_limits; every start of a rate-limited
-- queue or job type is logged in errands_rate_log (a sliding window, pruned by the leader).

ALTER TABLE {schema}.errands_jobs ADD COLUMN concurrency_limit integer;
ALTER TABLE {schema}.errands_queues ADD COLUMN has_keys boolean NOT NULL DEFAULT false;

CREATE TABLE {schema}.errands_job_limits (
    name        text PRIMARY KEY,
    queue       text NOT NULL,
    rate_limit  integer,
    rate_period double precision,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {schema}.errands_rate_log (
    bucket text        NOT NULL,
    at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX errands_rate_log_bucket ON {schema}.errands_rate_log (bucket, at);

-- Version 10 (issue 19): fair claiming across keys (tenants).
--
-- * errands_jobs.fair_key: the job's fair key (the template of @app.job(fair_key=...)),
--   built from its arguments at enqueue. It only matters in a fair queue.
-- * errands_jobs_fair: a fair queue's due rows per (key, priority), in claim order; the
--   fair claim skips through it (one probe per key and level), so a key's long backlog is
--   never read row by row.
-- * errands_jobs_fair_running: running rows per (queue, key): the worker time a key's
--   attempts in flight are using, and when the key last started one.
-- * errands_queues.fair, aging: app.queue(name, fair=True, aging=SECONDS).
-- * errands_fair_weights: app.fair_weight(key, weight), audited.
-- * errands_fair_usage: per (queue, key) the worker time of its ended attempts, decayed
--   (half-life errands.backends.fair.HALF_LIFE), and its dwell. Written only by the
--   fenced write that ends an attempt (finish, rescue, release, suspend), never by a claim.

ALTER TABLE {schema}.errands_jobs ADD COLUMN fair_key text;

CREATE INDEX errands_jobs_fair
    ON {schema}.errands_jobs (queue, fair_key, priority, run_at, id)
    WHERE state IN ('available', 'scheduled', 'retryable') AND fair_key IS NOT NULL;

CREATE INDEX errands_jobs_fair_running
    ON {schema}.errands_jobs (queue, fair_key)
    WHERE state = 'running' AND fair_key IS NOT NULL;

ALTER TABLE {schema}.errands_queues ADD COLUMN fair boolean NOT NULL DEFAULT false;
ALTER TABLE {schema}.errands_queues ADD COLUMN aging double precision;

CREATE TABLE {schema}.errands_fair_weights (
    key        text PRIMARY KEY,
    weight     double precision NOT NULL CHECK (weight > 0),
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text
);

CREATE TABLE {schema}.errands_fair_usage (
    queue         text NOT NULL,
    key           text NOT NULL,
    usage         double precision NOT NULL DEFAULT 0,
    recent        double precision NOT NULL DEFAULT 0,
    at            timestamptz      NOT NULL,
    last_started  timestamptz      NOT NULL,
    seconds_total double precision NOT NULL DEFAULT 0,
    dwell_total   double precision NOT NULL DEFAULT 0,
    attempts      bigint           NOT NULL DEFAULT 0,
    PRIMARY KEY (queue, key)
);

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

ALTER TABLE errands_jobs ADD COLUMN fair_key TEXT;

CREATE INDEX errands_jobs_fair
    ON errands_jobs (queue, fair_key, priority, run_at, id)
    WHERE state IN ('available', 'scheduled', 'retryable') AND fair_key IS NOT NULL;

CREATE INDEX errands_jobs_fair_running
    ON errands_jobs (queue, fair_key)
    WHERE state = 'running' AND fair_key IS NOT NULL;

ALTER TABLE errands_queues ADD COLUMN fair INTEGER NOT NULL DEFAULT 0;
ALTER TABLE errands_queues ADD COLUMN aging REAL;

CREATE TABLE errands_fair_weights (
    key        TEXT PRIMARY KEY,
    weight     REAL NOT NULL CHECK (weight > 0),
    updated_at REAL NOT NULL,
    updated_by TEXT
);

CREATE TABLE errands_fair_usage (
    queue         TEXT    NOT NULL,
    key           TEXT    NOT NULL,
    usage         REAL    NOT NULL DEFAULT 0,
    recent        REAL    NOT NULL DEFAULT 0,
    at            REAL    NOT NULL,
    last_started  REAL    NOT NULL,
    seconds_total REAL    NOT NULL DEFAULT 0,
    dwell_total   REAL    NOT NULL DEFAULT 0,
    attempts      INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (queue, key)
);

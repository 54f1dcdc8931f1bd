-- Version 2: durable steps, child jobs, unique_for, concurrency keys, the worker
-- registry, persisted queue settings (pause, limits, rates) and cron state.

ALTER TABLE errands_jobs ADD COLUMN parent_id INTEGER;
ALTER TABLE errands_jobs ADD COLUMN unique_until REAL;
ALTER TABLE errands_jobs ADD COLUMN concurrency_key TEXT;

CREATE INDEX errands_jobs_parent ON errands_jobs (parent_id) WHERE parent_id IS NOT NULL;
CREATE INDEX errands_jobs_running_key
    ON errands_jobs (concurrency_key)
    WHERE state = 'running' AND concurrency_key IS NOT NULL;

-- One stored result per (job, step name): a retry, rescue or replay gets it back.
CREATE TABLE errands_steps (
    job_id     INTEGER NOT NULL,
    name       TEXT    NOT NULL,
    result     TEXT,
    attempt    INTEGER NOT NULL,
    created_at REAL    NOT NULL,
    PRIMARY KEY (job_id, name)
);

CREATE TABLE errands_workers (
    id           TEXT PRIMARY KEY,
    host         TEXT    NOT NULL,
    pid          INTEGER NOT NULL,
    queues       TEXT    NOT NULL,
    concurrency  INTEGER NOT NULL,
    started_at   REAL    NOT NULL,
    heartbeat_at REAL    NOT NULL,
    in_flight    INTEGER NOT NULL DEFAULT 0,
    processed    INTEGER NOT NULL DEFAULT 0,
    version      TEXT    NOT NULL
);

CREATE TABLE errands_queues (
    name        TEXT PRIMARY KEY,
    paused      INTEGER NOT NULL DEFAULT 0,
    max_running INTEGER,
    rate_limit  INTEGER,
    rate_period REAL,
    updated_at  REAL    NOT NULL,
    updated_by  TEXT
);

CREATE TABLE errands_cron (
    name        TEXT PRIMARY KEY,
    expression  TEXT NOT NULL,
    timezone    TEXT NOT NULL,
    last_slot   REAL,
    last_job_id INTEGER,
    next_slot   REAL,
    updated_at  REAL NOT NULL
);

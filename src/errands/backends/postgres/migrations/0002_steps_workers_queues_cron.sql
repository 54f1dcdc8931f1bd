-- Version 2: durable steps, child jobs, unique_for, concurrency keys, the worker
-- registry, persisted queue settings (pause, limits, rates) and cron state.

ALTER TABLE {schema}.errands_jobs
    ADD COLUMN parent_id bigint,
    ADD COLUMN unique_until timestamptz,
    ADD COLUMN concurrency_key text;

CREATE INDEX errands_jobs_parent ON {schema}.errands_jobs (parent_id)
    WHERE parent_id IS NOT NULL;
CREATE INDEX errands_jobs_running_key ON {schema}.errands_jobs (concurrency_key)
    WHERE state = 'running' AND concurrency_key IS NOT NULL;

CREATE TABLE {schema}.errands_steps (
    job_id     bigint      NOT NULL,
    name       text        NOT NULL,
    result     jsonb,
    attempt    integer     NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, name)
);

CREATE TABLE {schema}.errands_workers (
    id           text PRIMARY KEY,
    host         text        NOT NULL,
    pid          integer     NOT NULL,
    queues       text        NOT NULL,
    concurrency  integer     NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    in_flight    integer     NOT NULL DEFAULT 0,
    processed    bigint      NOT NULL DEFAULT 0,
    version      text        NOT NULL
);

CREATE TABLE {schema}.errands_queues (
    name        text PRIMARY KEY,
    paused      boolean     NOT NULL DEFAULT false,
    max_running integer,
    rate_limit  integer,
    rate_period double precision,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    updated_by  text
);

CREATE TABLE {schema}.errands_cron (
    name        text PRIMARY KEY,
    expression  text        NOT NULL,
    timezone    text        NOT NULL,
    last_slot   timestamptz,
    last_job_id bigint,
    next_slot   timestamptz,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

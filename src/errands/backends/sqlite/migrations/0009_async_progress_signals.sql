-- Version 9 (issue 20): progress, durable signals, edits.
--
-- * A new state, 'waiting': a job suspended in ctx.wait_for_signal holds no lease and no
--   slot; app.signal (or its timeout, handled by the maintenance leader) moves it on.
--   SQLite cannot change a CHECK constraint in place: the table is rebuilt (the documented
--   twelve-step procedure), keeping every row, id and the id sequence's high-water mark.
-- * progress, progress_message: ctx.progress(), stored by the next heartbeat.
-- * wait_signal, wait_until: what a waiting job waits for, and until when.
-- * errands_signals: every signal sent to a job, kept (a signal sent before the wait is
--   there when the wait begins), deleted with the job.
-- Waiters on results see commits through PRAGMA data_version (no schema needed).

CREATE TABLE errands_jobs_new (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    name              TEXT    NOT NULL,
    queue             TEXT    NOT NULL,
    args              TEXT    NOT NULL,
    meta              TEXT    NOT NULL DEFAULT '{}',
    state             TEXT    NOT NULL CHECK (state IN ('scheduled', 'available', 'running',
                              'retryable', 'completed', 'dead', 'discarded', 'cancelled',
                              'waiting')),
    priority          INTEGER NOT NULL DEFAULT 0,
    attempt           INTEGER NOT NULL DEFAULT 0,
    max_attempts      INTEGER NOT NULL CHECK (max_attempts >= 1),
    run_at            REAL    NOT NULL,
    idempotency_key   TEXT,
    errors            TEXT    NOT NULL DEFAULT '[]',
    result            TEXT,
    inserted_at       REAL    NOT NULL,
    attempted_at      REAL,
    finished_at       REAL,
    lease_owner       TEXT,
    lease_token       TEXT,
    lease_expires_at  REAL,
    rescues           INTEGER NOT NULL DEFAULT 0,
    cancel_requested  INTEGER NOT NULL DEFAULT 0,
    timeout           REAL,
    lease_seconds     REAL,
    discarded_by      TEXT,
    discard_reason    TEXT,
    parent_id         INTEGER,
    unique_until      REAL,
    concurrency_key   TEXT,
    concurrency_limit INTEGER,
    rate_limit        INTEGER,
    rate_period       REAL,
    progress          REAL,
    progress_message  TEXT,
    wait_signal       TEXT,
    wait_until        REAL
);

INSERT INTO errands_jobs_new (
    id, name, queue, args, meta, state, priority, attempt, max_attempts, run_at,
    idempotency_key, errors, result, inserted_at, attempted_at, finished_at, lease_owner,
    lease_token, lease_expires_at, rescues, cancel_requested, timeout, lease_seconds,
    discarded_by, discard_reason, parent_id, unique_until, concurrency_key,
    concurrency_limit, rate_limit, rate_period)
SELECT
    id, name, queue, args, meta, state, priority, attempt, max_attempts, run_at,
    idempotency_key, errors, result, inserted_at, attempted_at, finished_at, lease_owner,
    lease_token, lease_expires_at, rescues, cancel_requested, timeout, lease_seconds,
    discarded_by, discard_reason, parent_id, unique_until, concurrency_key,
    concurrency_limit, rate_limit, rate_period
FROM errands_jobs;

-- Keep the id sequence's high-water mark: a pruned id is never handed out again.
DELETE FROM sqlite_sequence WHERE name = 'errands_jobs_new';
INSERT INTO sqlite_sequence (name, seq)
SELECT 'errands_jobs_new', seq FROM sqlite_sequence WHERE name = 'errands_jobs';

DROP TABLE errands_jobs;
ALTER TABLE errands_jobs_new RENAME TO errands_jobs;

CREATE INDEX errands_jobs_due
    ON errands_jobs (queue, priority DESC, run_at, id)
    WHERE state IN ('available', 'scheduled', 'retryable');
CREATE INDEX errands_jobs_leases
    ON errands_jobs (lease_expires_at)
    WHERE state = 'running';
CREATE INDEX errands_jobs_finished
    ON errands_jobs (finished_at)
    WHERE state IN ('completed', 'cancelled', 'discarded');
CREATE INDEX errands_jobs_state ON errands_jobs (state, queue, id);
CREATE UNIQUE INDEX errands_jobs_key
    ON errands_jobs (name, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX errands_jobs_waiting
    ON errands_jobs (run_at)
    WHERE state IN ('scheduled', 'retryable');
CREATE INDEX errands_jobs_parent ON errands_jobs (parent_id) WHERE parent_id IS NOT NULL;
CREATE INDEX errands_jobs_running_key
    ON errands_jobs (concurrency_key)
    WHERE state = 'running' AND concurrency_key IS NOT NULL;
CREATE INDEX errands_jobs_name ON errands_jobs (name, id);
CREATE INDEX errands_jobs_queue ON errands_jobs (queue, id);
CREATE INDEX errands_jobs_suspects
    ON errands_jobs (queue, priority DESC, run_at, id)
    WHERE state IN ('available', 'scheduled', 'retryable') AND rescues > 0;
CREATE INDEX errands_jobs_limited
    ON errands_jobs (queue, name)
    WHERE state IN ('available', 'scheduled', 'retryable')
      AND (concurrency_key IS NOT NULL OR rate_limit IS NOT NULL);
-- Waits the maintenance leader times out.
CREATE INDEX errands_jobs_signal_waits
    ON errands_jobs (wait_until)
    WHERE state = 'waiting';

CREATE TABLE errands_signals (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id  INTEGER NOT NULL,
    name    TEXT    NOT NULL,
    payload TEXT,
    sent_at REAL    NOT NULL,
    sent_by TEXT
);
CREATE INDEX errands_signals_job ON errands_signals (job_id, name, id);

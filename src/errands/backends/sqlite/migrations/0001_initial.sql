-- errands schema for SQLite, version 1. Times are unix epoch seconds (REAL) from the
-- database clock: (julianday('now') - 2440587.5) * 86400.0.

CREATE TABLE errands_jobs (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    name             TEXT    NOT NULL,
    queue            TEXT    NOT NULL,
    args             TEXT    NOT NULL,
    meta             TEXT    NOT NULL DEFAULT '{}',
    state            TEXT    NOT NULL CHECK (state IN ('scheduled', 'available', 'running',
                             'retryable', 'completed', 'dead', 'discarded', 'cancelled')),
    priority         INTEGER NOT NULL DEFAULT 0,
    attempt          INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL CHECK (max_attempts >= 1),
    run_at           REAL    NOT NULL,
    idempotency_key  TEXT,
    errors           TEXT    NOT NULL DEFAULT '[]',
    result           TEXT,
    inserted_at      REAL    NOT NULL,
    attempted_at     REAL,
    finished_at      REAL,
    lease_owner      TEXT,
    lease_token      TEXT,
    lease_expires_at REAL,
    rescues          INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    timeout          REAL,
    lease_seconds    REAL,
    discarded_by     TEXT,
    discard_reason   TEXT
);

-- Due work, in claim order; only pending rows are in it, so it stays small.
CREATE INDEX errands_jobs_due
    ON errands_jobs (queue, priority DESC, run_at, id)
    WHERE state IN ('available', 'scheduled', 'retryable');

-- Leases the rescuer looks at.
CREATE INDEX errands_jobs_leases
    ON errands_jobs (lease_expires_at)
    WHERE state = 'running';

-- Finished rows the pruner deletes.
CREATE INDEX errands_jobs_finished
    ON errands_jobs (finished_at)
    WHERE state IN ('completed', 'cancelled', 'discarded');

-- Admin listings by state (the DLQ above all).
CREATE INDEX errands_jobs_state ON errands_jobs (state, queue, id);

-- An idempotency key is unique per job name for as long as the row exists.
CREATE UNIQUE INDEX errands_jobs_key
    ON errands_jobs (name, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE TABLE errands_audit (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at      REAL    NOT NULL,
    actor   TEXT    NOT NULL,
    action  TEXT    NOT NULL,
    job_id  INTEGER,
    detail  TEXT    NOT NULL DEFAULT '{}'
);
CREATE INDEX errands_audit_job ON errands_audit (job_id, id);

CREATE TABLE errands_leaders (
    name       TEXT PRIMARY KEY,
    owner      TEXT NOT NULL,
    elected_at REAL NOT NULL,
    expires_at REAL NOT NULL
);

-- Scheduled and retryable rows the maintenance service promotes to available when due.
CREATE INDEX errands_jobs_waiting
    ON errands_jobs (run_at)
    WHERE state IN ('scheduled', 'retryable');

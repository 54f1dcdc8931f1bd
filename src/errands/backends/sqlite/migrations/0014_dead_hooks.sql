-- Version 14 (issue 16): on_dead hooks that a crash cannot lose. A job's death and the
-- record that its on_dead hooks are due are one write: a trigger adds the record in the
-- transaction that makes the job dead, whichever path does it (a worker's fenced finish,
-- the leader's rescue, a signal wait's timeout, a workflow member). The worker that ran
-- the hooks deletes the record; the leader runs the hooks of records older than the grace
-- (App(dead_hooks_grace=...)) itself: the worker that should have run them died, or fell
-- that far behind. So hooks run at least once per death (docs/guarantees.md).
CREATE TABLE errands_dead_hooks (
    job_id  INTEGER PRIMARY KEY,
    died_at REAL    NOT NULL
);
CREATE INDEX errands_dead_hooks_due ON errands_dead_hooks (died_at);

CREATE TRIGGER errands_jobs_dead_hooks
    AFTER UPDATE OF state ON errands_jobs
    FOR EACH ROW WHEN NEW.state = 'dead' AND OLD.state IS NOT 'dead'
BEGIN
    INSERT INTO errands_dead_hooks (job_id, died_at)
    VALUES (NEW.id, COALESCE(NEW.finished_at, (julianday('now') - 2440587.5) * 86400.0))
    ON CONFLICT (job_id) DO UPDATE SET died_at = excluded.died_at;
END;

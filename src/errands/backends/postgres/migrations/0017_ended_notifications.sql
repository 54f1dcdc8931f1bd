-- Version 17 (issue 17): announcing ended jobs no longer costs every UPDATE of the table.
-- Version 9's errands_jobs_done was a statement-level trigger with a transition table:
-- every UPDATE of errands_jobs (each claim and heartbeat too, which end nothing) copied
-- its new rows into that table for the trigger to read. Measured on the bench machine
-- (one worker, 100,000 no-op jobs): 11 % of the server's time in the claim and the
-- completion statements, and 11-14 % of the throughput.
--
-- The ids of ended jobs still reach errands_done_<schema> (results.py), two ways:
-- * an attempt's end (a worker's finish, release, the leader's rescue, a suspension
--   cancelled meanwhile) announces them in its own statement, once per statement, as the
--   trigger did (the notify_ended CTE of queries.sql);
-- * every other end (a job ended from any state but running: an operator's cancel or
--   discard, a signal wait's timeout, a workflow's cancel) is rare, and announced by a row
--   trigger whose WHEN lets only those rows through, so claims and attempts' ends, which
--   leave or enter running, queue no trigger event at all.
-- tests/postgres/test_ended_notifications.py checks that every statement that may end a
-- running job carries the CTE, and that each way a job ends wakes a listener.
--
-- Dropping a trigger locks errands_jobs against reads and writes until the migration
-- commits, and waits for every open transaction that touched the table first (a caller's
-- transaction that enqueued, a handler's ctx.transaction()): behind that wait every
-- claim and finish would queue. So it waits at most 5 s, then fails and rolls back
-- whole; run it again at a quieter moment.
SET LOCAL lock_timeout = '5s';
DROP TRIGGER IF EXISTS errands_jobs_done ON {schema}.errands_jobs;
DROP FUNCTION IF EXISTS {schema}.errands_jobs_notify_done();

CREATE FUNCTION {schema}.errands_jobs_notify_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('errands_done_' || TG_TABLE_SCHEMA, NEW.id::text);
    RETURN NULL;
END
$$;

CREATE TRIGGER errands_jobs_ended
    AFTER UPDATE OF state ON {schema}.errands_jobs
    FOR EACH ROW WHEN (OLD.state <> 'running'
                       AND NEW.state IN ('completed', 'dead', 'cancelled', 'discarded')
                       AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION {schema}.errands_jobs_notify_ended();

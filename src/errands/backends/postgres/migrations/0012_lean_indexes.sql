-- Version 12 (issue 17, item 4): less WAL per job. Claiming and finishing a job each
-- write a new version of its row, and neither can be a HOT update (both change state),
-- so each version is entered into every index whose predicate it matches. Before this
-- version that was four full indexes twice per job (pkey, state, name, queue): 59 % of
-- the ~1.4 KiB of WAL a job cost (bench/storage_notes.md has the measurements).
--
-- * errands_jobs_name and errands_jobs_queue (version 4, every row) are dropped, and
--   errands_jobs_state (every row) is replaced by two partial indexes that leave out the
--   two states every job passes through, running (few rows at a time:
--   errands_jobs_running finds them) and completed (the bulk, listed newest first by the
--   primary key):
--   errands_jobs_state_queue (state, queue, id) and errands_jobs_state_name
--   (state, name, id). A job that runs and completes adds no entry to either; pending,
--   waiting, dead, cancelled and discarded rows are listed by state plus queue or name
--   through them, in id order.
-- * errands_jobs_bloom: a BRIN bloom index over (queue, name), a summary per 8 heap pages
--   that finds the pages holding a rare queue or job name among millions of completed
--   rows. A range is summarised by (auto)vacuum, which this table gets every 1 % of dead
--   rows; a row version then costs WAL only when its value is new to its range's summary.
--   Ranges not yet summarised (the newest pages) are read by every such listing. Not
--   autosummarize: at bulk-enqueue rates its requests overflow autovacuum's work-item
--   queue, each one a line in the server log.
-- * errands_jobs_running (id) WHERE state = 'running' replaces errands_jobs_leases
--   (lease_expires_at, same condition): a heartbeat changes lease_expires_at and nothing
--   else any index reads, so it becomes a HOT update, with no index entry at all (232 ->
--   95 B of WAL per heartbeat measured). The rescue finds expired leases among the
--   running rows, which are few (each worker's in-flight and prefetched jobs), and sorts
--   them; a listing of running jobs pages through this index by id.
-- * fillfactor 50 (was 90, unless changed since): the claim's and the completion's row
--   versions then fit on their row's own page, so PostgreSQL logs only the changed bytes
--   of each and no extra lock record; finished rows take about the same space as before
--   (the room is filled by their own updates).
--
-- A job that runs once and completes now writes 2 primary-key entries, one in
-- errands_jobs_running and one in errands_jobs_finished. On a large live table, build the
-- new indexes first with CREATE INDEX CONCURRENTLY under the same names: these statements
-- then skip them.

CREATE INDEX IF NOT EXISTS errands_jobs_state_queue ON {schema}.errands_jobs (state, queue, id)
    WHERE state NOT IN ('running', 'completed');

CREATE INDEX IF NOT EXISTS errands_jobs_state_name ON {schema}.errands_jobs (state, name, id)
    WHERE state NOT IN ('running', 'completed');

CREATE INDEX IF NOT EXISTS errands_jobs_bloom ON {schema}.errands_jobs
    USING brin (queue text_bloom_ops (n_distinct_per_range = 64),
                name text_bloom_ops (n_distinct_per_range = 64))
    WITH (pages_per_range = 8);

CREATE INDEX IF NOT EXISTS errands_jobs_running ON {schema}.errands_jobs (id)
    WHERE state = 'running';

DROP INDEX IF EXISTS {schema}.errands_jobs_leases;
DROP INDEX IF EXISTS {schema}.errands_jobs_name;
DROP INDEX IF EXISTS {schema}.errands_jobs_queue;
DROP INDEX IF EXISTS {schema}.errands_jobs_state;

-- The shipped 90 only: a fillfactor an operator chose is kept (docs/postgres.md).
DO $$
BEGIN
    IF (SELECT 'fillfactor=90' = ANY(c.reloptions) FROM pg_class AS c
        WHERE c.oid = '{schema}.errands_jobs'::regclass) THEN
        ALTER TABLE {schema}.errands_jobs SET (fillfactor = 50);
    END IF;
END
$$;

-- Version 16 (issue 17): a job's enqueue writes two index entries fewer. Version 12 left
-- out of the listing indexes the two states every job passes through, running and
-- completed; a job passes through a third, available, and each enqueued job still paid an
-- entry in errands_jobs_state_queue and one in errands_jobs_state_name for it: a quarter
-- of a bulk enqueue's time on the server (1,000 jobs a call: 56,000 jobs a second with
-- them, 71,000 without, on the bench machine) and their WAL.
--
-- errands_jobs_listed_queue and errands_jobs_listed_name (state, queue / name, id) replace
-- them, holding the rows that are neither available, running nor completed: scheduled,
-- retryable, waiting, dead, cancelled and discarded ones. Available rows are listed
-- through what already holds them: by queue, errands_jobs_due (every pending row, by
-- queue first); by job name, the primary key newest first (a common name) or
-- errands_jobs_listing_bloom (a rare one); counted per job type (app.unrunnable_jobs)
-- through errands_jobs_due and their rows (tests/postgres/test_listing_plans.py).
--
-- On a large live table, build the new indexes first with CREATE INDEX CONCURRENTLY
-- under the same names (and drop the old ones the same way): these statements then skip
-- them. An index of either name left invalid by a failed CREATE INDEX CONCURRENTLY is
-- built again.
DO $$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY ARRAY['errands_jobs_listed_queue', 'errands_jobs_listed_name'] LOOP
        IF EXISTS (SELECT 1 FROM pg_index
                   WHERE indexrelid = to_regclass('{schema}.' || name) AND NOT indisvalid) THEN
            EXECUTE format('DROP INDEX {schema}.%I', name);
        END IF;
    END LOOP;
END
$$;

CREATE INDEX IF NOT EXISTS errands_jobs_listed_queue ON {schema}.errands_jobs (state, queue, id)
    WHERE state NOT IN ('available', 'running', 'completed');

CREATE INDEX IF NOT EXISTS errands_jobs_listed_name ON {schema}.errands_jobs (state, name, id)
    WHERE state NOT IN ('available', 'running', 'completed');

DROP INDEX IF EXISTS {schema}.errands_jobs_state_queue;
DROP INDEX IF EXISTS {schema}.errands_jobs_state_name;

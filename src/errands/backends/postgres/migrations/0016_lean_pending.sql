-- Version 16 (issue 17): a job's enqueue writes two index entries fewer. Version 12 left
-- out of the listing indexes the two states every job passes through, running and
-- completed; a job passes through a third, available, and each enqueued job still paid an
-- entry in errands_jobs_state_queue and one in errands_jobs_state_name for it: a quarter
-- of a bulk enqueue's time on the server (1,000 jobs a call: 56,000 jobs a second with
-- them, 69,000-72,000 without, on the bench machine) and their WAL.
--
-- errands_jobs_listed_queue and errands_jobs_listed_name (state, queue / name, id) replace
-- them, holding the rows that are neither available, running nor completed: scheduled,
-- retryable, waiting, dead, cancelled and discarded ones. Available rows are listed
-- through what already holds them: those of a queue by priority and due time through
-- errands_jobs_due (job_list_due); those of a job name in every queue newest first
-- through the primary key or errands_jobs_listing_bloom; they are counted per job type
-- (app.unrunnable_jobs) by reading the pending rows or the table
-- (tests/postgres/test_listing_plans.py).
--
-- On a large live table, build the new indexes first with CREATE INDEX CONCURRENTLY
-- under the same names (and drop the old ones the same way): these statements then skip
-- them. An index of either name left invalid by a failed CREATE INDEX CONCURRENTLY is
-- built again; one built with another condition stops the migration, named.
DO $$
DECLARE
    idx text;
BEGIN
    FOREACH idx IN ARRAY ARRAY['errands_jobs_listed_queue', 'errands_jobs_listed_name'] LOOP
        IF EXISTS (SELECT 1 FROM pg_index
                   WHERE indexrelid = to_regclass('{schema}.' || idx) AND NOT indisvalid) THEN
            EXECUTE format('DROP INDEX {schema}.%I', idx);
        ELSIF EXISTS (SELECT 1 FROM pg_index
                      WHERE indexrelid = to_regclass('{schema}.' || idx)
                        AND pg_get_expr(indpred, indrelid) NOT LIKE '%available%') THEN
            RAISE EXCEPTION 'index %.% exists with another condition than state NOT IN '
                '(''available'', ''running'', ''completed''): drop it, or build it with that '
                'condition, and migrate again', '{schema}', idx;
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

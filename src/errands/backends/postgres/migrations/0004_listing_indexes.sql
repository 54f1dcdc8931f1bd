-- Version 4: the dashboard's jobs page filters by job name or by queue alone and pages
-- newest first by id; without these, a rare name or queue is found by reading the whole
-- table. (Filters with a state use errands_jobs_state.) On a large live table, build them
-- first with CREATE INDEX CONCURRENTLY under the same names: these statements then skip.

CREATE INDEX IF NOT EXISTS errands_jobs_name ON {schema}.errands_jobs (name, id);
CREATE INDEX IF NOT EXISTS errands_jobs_queue ON {schema}.errands_jobs (queue, id);

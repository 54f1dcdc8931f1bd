-- Version 4: the dashboard's jobs page filters by job name or by queue alone and pages
-- newest first by id; without these, a rare name or queue is found by reading the whole
-- table. (Filters with a state use errands_jobs_state.)

CREATE INDEX IF NOT EXISTS errands_jobs_name ON errands_jobs (name, id);
CREATE INDEX IF NOT EXISTS errands_jobs_queue ON errands_jobs (queue, id);

-- Version 8: each worker records the job types its code defines (a JSON list), so
-- `errands status` and the dashboard can show pending jobs that no live worker can run
-- (a rolling deploy's newer job types: a worker never claims a type it does not define).

ALTER TABLE {schema}.errands_workers ADD COLUMN jobs text;

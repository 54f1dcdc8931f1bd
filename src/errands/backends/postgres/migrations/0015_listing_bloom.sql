-- Version 15 (issues 17 and 19): the BRIN bloom index of version 12 serves the job
-- listings and nothing else. A claim of a queue the statistics had not seen (a queue
-- newer than the last ANALYZE, or one outside its most common values: estimated at one
-- row) preferred it to errands_jobs_due, whose order it needs: a lossy bitmap scan of
-- every page range not summarised, then a sort. On 440,000 rows whose ranges no vacuum
-- had summarised, each claim of a new queue took 160 ms (29,000 pages) where the btree
-- reads a few pages, and the worker processed 170 jobs a second instead of 9,000.
--
-- Its columns now carry the "C" collation. PostgreSQL uses an index column for a
-- comparison in that column's collation only, so the listings, which compare in "C"
-- (`queue COLLATE "C" = ...`: equality in "C" and in any deterministic collation agree),
-- keep it, and no claim, which never does, can pick it whatever the statistics say
-- (tests/postgres/test_claim_plans.py). On a large live table, build it first with
-- CREATE INDEX CONCURRENTLY under the same name: this statement then skips it.
-- An index of that name left invalid by a failed CREATE INDEX CONCURRENTLY is built again.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index
               WHERE indexrelid = to_regclass('{schema}.errands_jobs_listing_bloom')
                 AND NOT indisvalid) THEN
        DROP INDEX {schema}.errands_jobs_listing_bloom;
    END IF;
END
$$;

CREATE INDEX IF NOT EXISTS errands_jobs_listing_bloom ON {schema}.errands_jobs
    USING brin (queue COLLATE "C" text_bloom_ops (n_distinct_per_range = 64),
                name COLLATE "C" text_bloom_ops (n_distinct_per_range = 64))
    WITH (pages_per_range = 8);

DROP INDEX IF EXISTS {schema}.errands_jobs_bloom;

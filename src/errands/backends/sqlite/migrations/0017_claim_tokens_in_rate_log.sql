-- Version 17: each start a limited claim logs in errands_rate_log carries the claim's
-- lease token (PostgreSQL's version 19 did the same), so the prefetched jobs a stopping
-- worker gives back before they began take back the starts their claim counted for them
-- (job_release_many with prefetched: rate_log_unstart). Before, they stayed counted
-- until their window passed: after a stop, a queue of '10/h' could lose most of an
-- hour's budget to jobs that never ran. Rows logged before keep NULL (never given back),
-- as do those of a release before this one still running beside it.
ALTER TABLE errands_rate_log ADD COLUMN token TEXT;
-- The give-back finds a claim's rows of a bucket by its token: through (bucket, at) it
-- read the bucket's whole window (up to its COUNT rows, a '100000/d' bucket's 100,000)
-- for each job given back, under the write lock. Partial: the rows of earlier releases
-- (NULL) are not in it.
CREATE INDEX errands_rate_log_token ON errands_rate_log (token, bucket)
WHERE token IS NOT NULL;

-- Version 5: suspects. A job rescued from a dead worker may have killed it, or may have
-- been a bystander. Suspects are claimed one at a time per worker, never beside another
-- suspect, so a crash-looping job cannot drag the jobs it was claimed with into the DLQ
-- as poison. This index finds them without scanning the rest of the backlog.

CREATE INDEX errands_jobs_suspects
    ON {schema}.errands_jobs (queue, priority DESC, run_at, id)
    WHERE state IN ('available', 'scheduled', 'retryable') AND rescues > 0;

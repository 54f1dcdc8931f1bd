-- All SQL of the SQLite backend. Times: unix epoch seconds from the database clock,
-- written (julianday('now') - 2440587.5) * 86400.0. Named parameters only, never
-- string formatting. Column order of RETURNING/SELECT lists matches errands.jobs.JobRow.

-- name: job_insert
INSERT INTO errands_jobs (name, queue, args, meta, state, priority, max_attempts, run_at,
                          idempotency_key, timeout, lease_seconds, inserted_at, parent_id,
                          unique_until, concurrency_key, concurrency_limit, rate_limit,
                          rate_period, fair_key)
SELECT :name, :queue, :args, :meta,
       CASE WHEN due > t_now + 0.0005 THEN 'scheduled' ELSE 'available' END,
       :priority, :max_attempts, due, :key, :timeout, :lease_seconds, t_now, :parent_id,
       CASE WHEN :unique_for IS NULL THEN NULL ELSE t_now + :unique_for END,
       :concurrency_key, :concurrency_limit, :rate_limit, :rate_period, :fair_key
FROM (SELECT COALESCE(:run_at, t_now + :delay) AS due, t_now
      FROM (SELECT (julianday('now') - 2440587.5) * 86400.0 AS t_now))
WHERE true
ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id

-- name: job_expire_key
-- unique_for: a key whose period is over is released (kept in meta as expired_key).
UPDATE errands_jobs
SET meta = json_set(meta, '$.expired_key', idempotency_key), idempotency_key = NULL
WHERE name = :name AND idempotency_key = :key
  AND unique_until IS NOT NULL AND unique_until <= (julianday('now') - 2440587.5) * 86400.0

-- name: job_id_by_key
SELECT id FROM errands_jobs WHERE name = :name AND idempotency_key = :key

-- name: job_claim
-- A queue's due rows in claim order. $RESCUED makes two variants (errands.backends.sqlfile):
-- job_claim takes fresh rows (rescues = 0), job_claim_suspect rescued ones (rescues > 0,
-- through their own partial index). Rows carrying a limit (a concurrency key or a rate)
-- are never taken here: the worker claims them through claim_limited, which counts them.
-- Nor a queue whose stored settings limit it (another deployment's max_running, rate or
-- fairness): a worker that has not learnt it yet claimed it past them.
UPDATE errands_jobs
SET state = 'running',
    attempt = attempt + 1,
    lease_owner = :worker_id,
    lease_token = :token,
    lease_expires_at = (julianday('now') - 2440587.5) * 86400.0
                       + COALESCE(lease_seconds, :lease_default),
    attempted_at = (julianday('now') - 2440587.5) * 86400.0,
    progress = NULL, progress_message = NULL
WHERE id IN (
    SELECT id FROM errands_jobs
    WHERE state IN ('available', 'scheduled', 'retryable')
      AND queue = :queue
      AND run_at <= (julianday('now') - 2440587.5) * 86400.0
      AND $RESCUED
      AND concurrency_key IS NULL AND rate_limit IS NULL
      AND (:names IS NULL OR name IN (SELECT value FROM json_each(:names)))
      AND NOT EXISTS (SELECT 1 FROM errands_queues
                      WHERE name = :queue
                        AND (paused = 1 OR max_running IS NOT NULL OR rate_limit IS NOT NULL
                             OR fair = 1 OR aging IS NOT NULL))
    ORDER BY priority DESC, run_at, id
    LIMIT :limit
)
RETURNING id, name, queue, args, meta, state, priority, attempt, max_attempts, run_at,
          idempotency_key, errors, result, inserted_at, attempted_at, finished_at,
          lease_owner, lease_token, lease_expires_at, rescues, cancel_requested, timeout,
          lease_seconds, discarded_by, discard_reason, parent_id, unique_until,
          progress, progress_message, wait_signal, wait_until, fair_key

-- name: job_finish
-- A cancel requested while the job ran turns a failure (retry or dead) into 'cancelled':
-- it never runs again, and an operator's cancel is not reported as a dead job.
UPDATE errands_jobs
SET state = CASE WHEN cancel_requested = 1 AND :state IN ('retryable', 'dead')
                 THEN 'cancelled' ELSE :state END,
    result = :result,
    errors = CASE WHEN :error IS NULL THEN errors
                  ELSE json_insert(errors, '$[#]',
                       json_set(json(:error), '$.at', (julianday('now') - 2440587.5) * 86400.0))
             END,
    run_at = CASE WHEN :state = 'retryable'
                  THEN (julianday('now') - 2440587.5) * 86400.0 + :delay ELSE run_at END,
    finished_at = CASE WHEN :state = 'retryable' AND cancel_requested = 0 THEN NULL
                       ELSE (julianday('now') - 2440587.5) * 86400.0 END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
WHERE id = :id AND lease_token = :token AND state = 'running'
RETURNING workflow_id, state

-- name: job_heartbeat
-- The handler's latest ctx.progress rides on the heartbeat (NULL: unchanged).
UPDATE errands_jobs
SET lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 + :lease_seconds,
    progress = COALESCE(:progress, progress),
    progress_message = CASE WHEN :progress IS NULL THEN progress_message ELSE :message END
WHERE id = :id AND lease_token = :token AND state = 'running'
RETURNING id, lease_token, cancel_requested

-- name: job_release
-- Shutdown: the attempt is given back uncharged (attempt - 1), and recorded in errors with
-- kind 'released', its attempt number and lease token, so the run that follows is
-- explained (I4). :unrun (its handler never ran: no child process could start for it): a
-- release like the job's last entry (the same attempt, the same message) is counted in
-- that entry ('times'; its worker, token and time the latest) rather than appended: a
-- job released every 30 s for a cause that lasts grew its errors by ~2,880 entries a day.
-- :prefetched (claimed, never begun): nothing is recorded and the job keeps its run_at
-- (due again in its place), as if never claimed (the caller folds nothing for it). Its
-- starts against rates go back with it, in the same transaction (rate_log_unstart). :delay: a
-- pause before the job is due again (run_at now + delay; 'retryable' while it waits, as
-- after a backoff): a job whose ctx.transaction() met a store that cannot write is given
-- back with a growing pause rather than run again at once, in a tight loop.
UPDATE errands_jobs
SET state = CASE WHEN cancel_requested = 1 THEN 'cancelled'
                 WHEN :delay > 0 AND NOT :prefetched THEN 'retryable'
                 ELSE 'available' END,
    errors = CASE
        WHEN :prefetched THEN errors
        WHEN :unrun AND json_extract(errors, '$[#-1].kind') = 'released'
         AND json_extract(errors, '$[#-1].message') = :message
         AND json_extract(errors, '$[#-1].attempt') = attempt
        THEN json_set(errors,
            '$[#-1].times', coalesce(json_extract(errors, '$[#-1].times'), 1) + 1,
            '$[#-1].worker', lease_owner, '$[#-1].lease_token', lease_token,
            '$[#-1].at', (julianday('now') - 2440587.5) * 86400.0)
        ELSE json_insert(errors, '$[#]', json_object(
            'attempt', attempt, 'type', 'Released', 'message', :message, 'traceback', NULL,
            'worker', lease_owner, 'kind', 'released', 'lease_token', lease_token,
            'at', (julianday('now') - 2440587.5) * 86400.0))
    END,
    attempt = attempt - 1,
    run_at = CASE WHEN :prefetched THEN run_at
                  ELSE (julianday('now') - 2440587.5) * 86400.0 + :delay END,
    finished_at = CASE WHEN cancel_requested = 1
                       THEN (julianday('now') - 2440587.5) * 86400.0 END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
WHERE id = :id AND lease_token = :token AND state = 'running'
RETURNING workflow_id, state

-- name: leader_attempt_elect
INSERT INTO errands_leaders (name, owner, elected_at, expires_at)
VALUES (:name, :owner, (julianday('now') - 2440587.5) * 86400.0,
        (julianday('now') - 2440587.5) * 86400.0 + :ttl)
ON CONFLICT (name) DO UPDATE
SET owner = excluded.owner,
    elected_at = CASE WHEN errands_leaders.owner = excluded.owner
                      THEN errands_leaders.elected_at ELSE excluded.elected_at END,
    expires_at = excluded.expires_at
WHERE errands_leaders.owner = excluded.owner
   OR errands_leaders.expires_at < (julianday('now') - 2440587.5) * 86400.0
RETURNING owner

-- name: leader_resign
DELETE FROM errands_leaders WHERE name = :name AND owner = :owner

-- name: job_list_expired
SELECT id, name, queue, lease_token, attempt, max_attempts, rescues, cancel_requested,
       lease_owner, fair_key IS NOT NULL
FROM errands_jobs
WHERE state = 'running' AND lease_expires_at < (julianday('now') - 2440587.5) * 86400.0
ORDER BY lease_expires_at
LIMIT :limit

-- name: job_rescue
-- Fenced three times (see PostgreSQL's): the expired claim's token, the lease still
-- expired, and no cancel requested since a plan that is not 'cancelled' was made.
UPDATE errands_jobs
SET state = :state,
    rescues = rescues + 1,
    errors = json_insert(errors, '$[#]',
             json_set(json(:error), '$.at', (julianday('now') - 2440587.5) * 86400.0)),
    run_at = (julianday('now') - 2440587.5) * 86400.0 + :delay,
    finished_at = CASE WHEN :state != 'retryable'
                       THEN (julianday('now') - 2440587.5) * 86400.0 END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
WHERE id = :id AND lease_token = :token AND state = 'running'
  AND lease_expires_at < (julianday('now') - 2440587.5) * 86400.0
  AND (cancel_requested = 0 OR :state = 'cancelled')
RETURNING workflow_id, state

-- name: job_promote_due
-- At most :limit rows a call (see PostgreSQL's): the write lock is held that long.
UPDATE errands_jobs
SET state = 'available'
WHERE id IN (SELECT id FROM errands_jobs
             WHERE state IN ('scheduled', 'retryable')
               AND run_at <= (julianday('now') - 2440587.5) * 86400.0
             LIMIT :limit)

-- name: job_prunable
-- A workflow's member stays while its workflow does (a dependent yet to run, the
-- workflow's result and its callbacks read it), whatever its age: pruned, it read as a
-- completed parent with no result. Workflows go by their outermost one's settle time
-- (wf_prunable), their members with them. INDEXED BY: SQLite's planner (errands never runs
-- ANALYZE) chose errands_jobs_state, and read every finished row kept, under the write
-- lock, to find none past the retention (0.05-0.09 s a call at 197,000 rows); the
-- partial index on finished_at reads only the rows past it.
SELECT id FROM errands_jobs AS j INDEXED BY errands_jobs_finished
WHERE state IN ('completed', 'cancelled', 'discarded')
  AND finished_at < (julianday('now') - 2440587.5) * 86400.0 - :older_than
  AND (j.workflow_id IS NULL
       OR NOT EXISTS (SELECT 1 FROM errands_workflows AS w WHERE w.id = j.workflow_id))
LIMIT :limit

-- name: job_delete
DELETE FROM errands_jobs WHERE id = :id

-- name: steps_delete
DELETE FROM errands_steps WHERE job_id = :job_id

-- name: steps_delete_many
DELETE FROM errands_steps WHERE job_id IN (SELECT value FROM json_each(:ids))

-- name: job_get
SELECT id, name, queue, args, meta, state, priority, attempt, max_attempts, run_at,
       idempotency_key, errors, result, inserted_at, attempted_at, finished_at,
       lease_owner, lease_token, lease_expires_at, rescues, cancel_requested, timeout,
       lease_seconds, discarded_by, discard_reason, parent_id, unique_until,
          progress, progress_message, wait_signal, wait_until, fair_key
FROM errands_jobs WHERE id = :id

-- name: job_list
SELECT id, name, queue, args, meta, state, priority, attempt, max_attempts, run_at,
       idempotency_key, errors, result, inserted_at, attempted_at, finished_at,
       lease_owner, lease_token, lease_expires_at, rescues, cancel_requested, timeout,
       lease_seconds, discarded_by, discard_reason, parent_id, unique_until,
          progress, progress_message, wait_signal, wait_until, fair_key
FROM errands_jobs
WHERE (:state IS NULL OR state = :state)
  AND (:queue IS NULL OR queue = :queue)
  AND (:name IS NULL OR name = :name)
  AND (:before_id IS NULL OR id < :before_id)
  AND (:parent_id IS NULL OR parent_id = :parent_id)
ORDER BY id DESC
LIMIT :limit

-- name: job_list_due
-- Available jobs of one queue by priority, then due time, then id (a plain queue's claim
-- order: next first), through errands_jobs_due, as on PostgreSQL (whose listing indexes
-- hold no available row since its schema version 16). The first page; the next ones:
-- job_list_due_after.
SELECT id, name, queue, args, meta, state, priority, attempt, max_attempts, run_at,
       idempotency_key, errors, result, inserted_at, attempted_at, finished_at,
       lease_owner, lease_token, lease_expires_at, rescues, cancel_requested, timeout,
       lease_seconds, discarded_by, discard_reason, parent_id, unique_until,
       progress, progress_message, wait_signal, wait_until, fair_key
FROM errands_jobs
WHERE state IN ('available', 'scheduled', 'retryable') AND state = 'available'
  AND queue = :queue
  AND (:name IS NULL OR name = :name)
  AND (:parent_id IS NULL OR parent_id = :parent_id)
ORDER BY priority DESC, run_at, id
LIMIT :limit

-- name: job_list_due_after
-- The page of job_list_due after the position (after_priority, after_due: the due time as
-- stored, epoch seconds to the last bit, after_id) of the previous page's last row
-- (Job.cursor). The rows after it at its priority, then the lower priorities: two index
-- ranges, hence the filters twice.
SELECT * FROM (
    SELECT * FROM (
     SELECT id, name, queue, args, meta, state, priority, attempt, max_attempts, run_at,
            idempotency_key, errors, result, inserted_at, attempted_at, finished_at,
            lease_owner, lease_token, lease_expires_at, rescues, cancel_requested, timeout,
            lease_seconds, discarded_by, discard_reason, parent_id, unique_until,
            progress, progress_message, wait_signal, wait_until, fair_key
     FROM errands_jobs
     WHERE state IN ('available', 'scheduled', 'retryable') AND state = 'available'
       AND queue = :queue
       AND (:name IS NULL OR name = :name)
       AND (:parent_id IS NULL OR parent_id = :parent_id)
       AND priority = :after_priority
       AND (run_at, id) > (:after_due, :after_id)
     ORDER BY run_at, id
     LIMIT :limit)
    UNION ALL
    SELECT * FROM (
     SELECT id, name, queue, args, meta, state, priority, attempt, max_attempts, run_at,
            idempotency_key, errors, result, inserted_at, attempted_at, finished_at,
            lease_owner, lease_token, lease_expires_at, rescues, cancel_requested, timeout,
            lease_seconds, discarded_by, discard_reason, parent_id, unique_until,
            progress, progress_message, wait_signal, wait_until, fair_key
     FROM errands_jobs
     WHERE state IN ('available', 'scheduled', 'retryable') AND state = 'available'
       AND queue = :queue
       AND (:name IS NULL OR name = :name)
       AND (:parent_id IS NULL OR parent_id = :parent_id)
       AND priority < :after_priority
     ORDER BY priority DESC, run_at, id
     LIMIT :limit)
)
ORDER BY 7 DESC, 10, 1  -- priority, run_at, id
LIMIT :limit

-- name: job_ids_matching
-- A bulk DLQ action's jobs (its dry run is only this read: no write lock).
SELECT id FROM errands_jobs
WHERE state = :state
  AND (:queue IS NULL OR queue = :queue)
  AND (:name IS NULL OR name = :name)
ORDER BY id

-- name: job_state
SELECT state FROM errands_jobs WHERE id = :id

-- name: job_states
SELECT id, state FROM errands_jobs WHERE id IN (SELECT value FROM json_each(:ids))

-- name: job_get_many
SELECT id, name, queue, args, meta, state, priority, attempt, max_attempts, run_at,
       idempotency_key, errors, result, inserted_at, attempted_at, finished_at,
       lease_owner, lease_token, lease_expires_at, rescues, cancel_requested, timeout,
       lease_seconds, discarded_by, discard_reason, parent_id, unique_until,
       progress, progress_message, wait_signal, wait_until, fair_key
FROM errands_jobs WHERE id IN (SELECT value FROM json_each(:ids))

-- name: queue_stats
SELECT queue, state, count(*) AS n,
       min(CASE WHEN state IN ('available', 'scheduled', 'retryable')
                 AND run_at <= (julianday('now') - 2440587.5) * 86400.0
                THEN run_at END) AS oldest_due,
       (julianday('now') - 2440587.5) * 86400.0 AS now,
       sum(state = 'running'
           AND lease_expires_at < (julianday('now') - 2440587.5) * 86400.0) AS stalled
FROM errands_jobs
GROUP BY queue, state

-- name: job_replay
-- The jobs of :ids (a JSON list) still dead back to available, in one statement however
-- many (row by row, 1,000,000 held the write lock for three minutes); their ids and
-- queues.
UPDATE errands_jobs
SET state = 'available', attempt = 0, rescues = 0, cancel_requested = 0,
    run_at = (julianday('now') - 2440587.5) * 86400.0, finished_at = NULL
WHERE id IN (SELECT value FROM json_each(:ids)) AND state = 'dead'
RETURNING id, queue

-- name: job_discard
-- The jobs of :ids (a JSON list) still dead to discarded, in one statement; their ids and
-- queues.
UPDATE errands_jobs
SET state = 'discarded', discarded_by = :actor, discard_reason = :reason,
    finished_at = (julianday('now') - 2440587.5) * 86400.0
WHERE id IN (SELECT value FROM json_each(:ids)) AND state = 'dead'
RETURNING id, queue

-- name: job_cancel_pending
UPDATE errands_jobs
SET state = 'cancelled', finished_at = (julianday('now') - 2440587.5) * 86400.0,
    wait_signal = NULL, wait_until = NULL
WHERE id = :id AND state IN ('available', 'scheduled', 'retryable', 'waiting')

-- name: job_cancel_running
UPDATE errands_jobs SET cancel_requested = 1 WHERE id = :id AND state = 'running'

-- name: audit_insert
INSERT INTO errands_audit (at, actor, action, job_id, detail)
VALUES ((julianday('now') - 2440587.5) * 86400.0, :actor, :action, :job_id, :detail)

-- name: audit_insert_many
-- One audit row per job of :ids (a JSON list), in its order, all with the same actor,
-- action and detail (a bulk replay or discard).
INSERT INTO errands_audit (at, actor, action, job_id, detail)
SELECT (julianday('now') - 2440587.5) * 86400.0, :actor, :action, value, :detail
FROM json_each(:ids)
ORDER BY key

-- name: audit_list
SELECT id, at, actor, action, job_id, detail FROM errands_audit
WHERE (:job_id IS NULL OR job_id = :job_id)
ORDER BY id DESC
LIMIT :limit

-- name: db_now
SELECT (julianday('now') - 2440587.5) * 86400.0

-- name: worker_register
INSERT INTO errands_workers (id, host, pid, queues, concurrency, started_at, heartbeat_at,
                             in_flight, processed, version, jobs, beat_seconds)
VALUES (:id, :host, :pid, :queues, :concurrency, (julianday('now') - 2440587.5) * 86400.0,
        (julianday('now') - 2440587.5) * 86400.0, 0, 0, :version, :jobs, :beat_seconds)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at, jobs = excluded.jobs,
                               beat_seconds = excluded.beat_seconds

-- name: worker_heartbeat
UPDATE errands_workers
SET heartbeat_at = (julianday('now') - 2440587.5) * 86400.0,
    in_flight = :in_flight, processed = :processed
WHERE id = :id

-- name: worker_deregister
DELETE FROM errands_workers WHERE id = :id

-- name: worker_list
SELECT id, host, pid, queues, concurrency, started_at, heartbeat_at, in_flight, processed,
       version, (julianday('now') - 2440587.5) * 86400.0 - heartbeat_at, jobs, beat_seconds
FROM errands_workers
ORDER BY started_at

-- name: job_count_pending_by_name
-- Due and waiting jobs per job type (for the jobs no live worker can run).
SELECT name, count(*) FROM errands_jobs
WHERE state IN ('available', 'scheduled', 'retryable')
GROUP BY name

-- name: worker_prune
-- Silent for older_than, or for ten of its own beats when that is longer (a worker with a
-- 15-minute lease beats every 5 minutes: it was forgotten between two beats).
DELETE FROM errands_workers
WHERE heartbeat_at < (julianday('now') - 2440587.5) * 86400.0
                     - max(:older_than, 10 * COALESCE(beat_seconds, 0))

-- name: step_list
SELECT job_id, name, result, attempt, created_at FROM errands_steps
WHERE job_id = :job_id
ORDER BY created_at, name

-- name: step_insert
INSERT INTO errands_steps (job_id, name, result, attempt, created_at)
VALUES (:job_id, :name, :result, :attempt, (julianday('now') - 2440587.5) * 86400.0)
ON CONFLICT (job_id, name) DO NOTHING

-- name: step_get
SELECT result FROM errands_steps WHERE job_id = :job_id AND name = :name

-- name: store_health
SELECT page_count, freelist_count FROM pragma_page_count(), pragma_freelist_count()

-- name: job_throughput
-- Per bucket and queue over the last :since seconds: completed and dead jobs (by
-- finished_at) and failed attempts (by each error's "at"). A job that failed in the window
-- is now pending or running, or finished inside the window, so only those rows are read.
WITH bounds AS (SELECT (julianday('now') - 2440587.5) * 86400.0 - :since AS since),
candidates AS (
    SELECT j.queue, j.state, j.finished_at, j.errors FROM errands_jobs AS j, bounds
    WHERE j.state IN ('completed', 'cancelled', 'discarded') AND j.finished_at >= bounds.since
    UNION ALL
    SELECT j.queue, j.state, j.finished_at, j.errors FROM errands_jobs AS j, bounds
    WHERE j.state = 'dead' AND j.finished_at >= bounds.since
    UNION ALL
    SELECT j.queue, j.state, j.finished_at, j.errors FROM errands_jobs AS j
    WHERE j.state IN ('available', 'scheduled', 'retryable', 'running') AND j.errors != '[]'
),
events AS (
    SELECT queue, state AS kind, finished_at AS at FROM candidates
    WHERE state IN ('completed', 'dead')
    UNION ALL
    SELECT c.queue, 'failed', json_extract(e.value, '$.at')
    FROM candidates AS c, json_each(c.errors) AS e, bounds
    WHERE c.errors != '[]' AND json_extract(e.value, '$.at') >= bounds.since
      AND json_extract(e.value, '$.kind') IS NOT 'released'
)
SELECT CAST(at / :bucket AS INTEGER) * :bucket AS bucket, queue,
       sum(kind = 'completed'), sum(kind = 'dead'), sum(kind = 'failed')
FROM events
GROUP BY bucket, queue
ORDER BY bucket, queue

-- name: job_find_by_key
-- Jobs with this idempotency key under any name: one probe of the (name, key) index per
-- distinct name, the names found by skipping through that index.
WITH RECURSIVE names(name) AS (
    SELECT min(name) FROM errands_jobs WHERE idempotency_key IS NOT NULL
    UNION ALL
    SELECT (SELECT min(j.name) FROM errands_jobs AS j
            WHERE j.idempotency_key IS NOT NULL AND j.name > names.name)
    FROM names WHERE names.name IS NOT NULL
)
SELECT j.id, j.name, j.queue, j.args, j.meta, j.state, j.priority, j.attempt, j.max_attempts,
       j.run_at, j.idempotency_key, j.errors, j.result, j.inserted_at, j.attempted_at,
       j.finished_at, j.lease_owner, j.lease_token, j.lease_expires_at, j.rescues,
       j.cancel_requested, j.timeout, j.lease_seconds, j.discarded_by, j.discard_reason,
       j.parent_id, j.unique_until, j.progress, j.progress_message, j.wait_signal,
       j.wait_until, j.fair_key
FROM names JOIN errands_jobs AS j ON j.name = names.name AND j.idempotency_key = :key
ORDER BY j.id DESC
LIMIT :limit

-- name: queue_settings_get
SELECT name, paused, max_running, rate_limit, rate_period, has_keys, updated_at, updated_by,
       fair, aging
FROM errands_queues WHERE name = :name

-- name: queue_settings_list
SELECT name, paused, max_running, rate_limit, rate_period, has_keys, updated_at, updated_by,
       fair, aging
FROM errands_queues ORDER BY name

-- name: queue_declare
INSERT INTO errands_queues (name, max_running, rate_limit, rate_period, has_keys, updated_at,
                            updated_by, fair, aging)
VALUES (:name, :max_running, :rate_limit, :rate_period, :has_keys, (julianday('now') - 2440587.5) * 86400.0, :actor,
        :fair, :aging)
ON CONFLICT (name) DO UPDATE
SET max_running = excluded.max_running, rate_limit = excluded.rate_limit,
    rate_period = excluded.rate_period, has_keys = max(has_keys, excluded.has_keys),
    updated_at = excluded.updated_at, updated_by = excluded.updated_by,
    fair = excluded.fair, aging = excluded.aging
WHERE max_running IS NOT excluded.max_running OR rate_limit IS NOT excluded.rate_limit
   OR rate_period IS NOT excluded.rate_period OR (excluded.has_keys = 1 AND has_keys = 0)
   OR fair IS NOT excluded.fair OR aging IS NOT excluded.aging

-- name: queue_declare_keyed
-- A queue this worker's code has limited job types in but does not declare: has_keys on,
-- nothing else written (the settings are whoever declared them).
INSERT INTO errands_queues (name, has_keys, updated_at, updated_by)
VALUES (:name, 1, (julianday('now') - 2440587.5) * 86400.0, :actor)
ON CONFLICT (name) DO UPDATE
SET has_keys = 1, updated_at = excluded.updated_at, updated_by = excluded.updated_by
WHERE has_keys = 0

-- name: queue_set_paused
INSERT INTO errands_queues (name, paused, updated_at, updated_by)
VALUES (:name, :paused, (julianday('now') - 2440587.5) * 86400.0, :actor)
ON CONFLICT (name) DO UPDATE
SET paused = excluded.paused, updated_at = excluded.updated_at, updated_by = excluded.updated_by

-- name: job_limit_declare
INSERT INTO errands_job_limits (name, queue, rate_limit, rate_period, updated_at)
VALUES (:name, :queue, :rate_limit, :rate_period, (julianday('now') - 2440587.5) * 86400.0)
ON CONFLICT (name) DO UPDATE
SET queue = excluded.queue, rate_limit = excluded.rate_limit,
    rate_period = excluded.rate_period, updated_at = excluded.updated_at

-- name: rate_limited_names
-- The rate-limited job types with due rows in a queue, each with its rate (a row's own:
-- rows of one type agree but while a deploy changes the rate). A loose index scan over
-- errands_jobs_limited: one probe per distinct name, however many rows each has.
WITH RECURSIVE names(name) AS (
    SELECT min(name) FROM errands_jobs
    WHERE queue = :queue AND state IN ('available', 'scheduled', 'retryable')
      AND (concurrency_key IS NOT NULL OR rate_limit IS NOT NULL) AND rate_limit IS NOT NULL
    UNION ALL
    SELECT (SELECT min(j.name) FROM errands_jobs AS j
            WHERE j.queue = :queue AND j.state IN ('available', 'scheduled', 'retryable')
              AND (j.concurrency_key IS NOT NULL OR j.rate_limit IS NOT NULL)
              AND j.rate_limit IS NOT NULL AND j.name > names.name)
    FROM names WHERE names.name IS NOT NULL
)
SELECT n.name, r.rate_limit, r.rate_period
FROM names AS n
JOIN errands_jobs AS r ON r.id = (
    SELECT id FROM errands_jobs
    WHERE queue = :queue AND name = n.name AND state IN ('available', 'scheduled', 'retryable')
      AND (concurrency_key IS NOT NULL OR rate_limit IS NOT NULL) AND rate_limit IS NOT NULL
    LIMIT 1)

-- name: queues_with_limits
-- Which of a worker's queues (:queues, a JSON list) must be claimed through claim_limited:
-- a queue with a cluster-wide limit or rate, or with due rows that carry a limit of their
-- own (a concurrency key or a job type's rate), whatever queue they were enqueued into.
SELECT q.value FROM json_each(:queues) AS q
WHERE EXISTS (SELECT 1 FROM errands_queues AS s
              WHERE s.name = q.value
                AND (s.max_running IS NOT NULL OR s.rate_limit IS NOT NULL OR s.fair = 1
                     OR s.aging IS NOT NULL))
   OR EXISTS (SELECT 1 FROM errands_jobs AS j
              WHERE j.queue = q.value AND j.state IN ('available', 'scheduled', 'retryable')
                AND (j.concurrency_key IS NOT NULL OR j.rate_limit IS NOT NULL))

-- name: dead_hooks_forget
-- Records of on_dead hooks whose job is no longer dead (replayed, discarded, deleted):
-- nothing to run for them.
DELETE FROM errands_dead_hooks
WHERE died_at < (julianday('now') - 2440587.5) * 86400.0 - :older_than
  AND NOT EXISTS (SELECT 1 FROM errands_jobs AS j
                  WHERE j.id = errands_dead_hooks.job_id AND j.state = 'dead')

-- name: dead_hooks_due
-- Dead jobs whose on_dead hooks are due longer than older_than seconds, oldest first.
SELECT job_id FROM errands_dead_hooks
WHERE died_at < (julianday('now') - 2440587.5) * 86400.0 - :older_than
ORDER BY died_at
LIMIT :limit

-- name: dead_hooks_done
-- The hooks of the job's death at died_at ran (a later death keeps its record; the
-- millisecond covers the float the caller read the time as).
DELETE FROM errands_dead_hooks WHERE job_id = :job_id AND died_at <= :died_at + 0.001

-- name: queue_running_count
SELECT count(*) FROM errands_jobs WHERE state = 'running' AND queue = :queue

-- name: rate_count
-- Starts inside the window, and when the oldest of them leaves it (seconds from now).
SELECT count(*), min(at) + :period - (julianday('now') - 2440587.5) * 86400.0
FROM errands_rate_log
WHERE bucket = :bucket AND at > (julianday('now') - 2440587.5) * 86400.0 - :period

-- name: rate_log_insert
-- Each start is kept with its bucket's period: pruning keeps a bucket's rows for exactly
-- the window its count reads (a '1000/s' bucket holds about a second of rows, not a day);
-- and with its claim's lease token, so a job of the claim given back before it began
-- takes its starts back (rate_log_unstart).
INSERT INTO errands_rate_log (bucket, at, period, token)
VALUES (:bucket, (julianday('now') - 2440587.5) * 86400.0, :period, :token)

-- name: rate_log_unstart
-- A prefetched job just given back (job_release, prefetched: claimed, never begun): the
-- starts its claim logged for it against rates go back too, as PostgreSQL's do; a
-- rate-limited queue counted each such job twice (the claim given back at a stop, then
-- its run), and a '10/h' queue could lose most of an hour to jobs that never ran. A claim
-- logs one row per job it starts in each bucket the job counts in (its queue's
-- 'queue:<queue>', its type's 'job:<name>'), all with the claim's lease token, which the
-- claim's jobs that began share (they keep theirs): one row of that token a bucket goes
-- for this job, any one (one claim's rows of one bucket are alike). A bucket the job did
-- not count in has no row of the token. Through errands_rate_log_token.
WITH buckets(bucket) AS (
    SELECT 'queue:' || queue FROM errands_jobs WHERE id = :id
    UNION ALL
    SELECT 'job:' || name FROM errands_jobs WHERE id = :id
)
DELETE FROM errands_rate_log
WHERE rowid IN (
    SELECT (SELECT l.rowid FROM errands_rate_log AS l
            WHERE l.token = :token AND l.bucket = b.bucket LIMIT 1)
    FROM buckets AS b
)

-- name: rate_log_prune
DELETE FROM errands_rate_log
WHERE at < (julianday('now') - 2440587.5) * 86400.0 - min(period, :older_than)

-- name: fair_usage_prune
-- See the PostgreSQL statement: keys idle past the retention, none running or pending.
DELETE FROM errands_fair_usage
WHERE at < (julianday('now') - 2440587.5) * 86400.0 - :older_than
  AND (queue, key) IN (
    SELECT u.queue, u.key FROM errands_fair_usage AS u
    WHERE u.at < (julianday('now') - 2440587.5) * 86400.0 - :older_than
      AND NOT EXISTS (SELECT 1 FROM errands_jobs AS j
                      WHERE j.queue = u.queue AND j.fair_key = u.key AND j.state = 'running')
      AND NOT EXISTS (SELECT 1 FROM errands_jobs AS j
                      WHERE j.queue = u.queue AND j.fair_key = u.key
                        AND j.state IN ('available', 'scheduled', 'retryable'))
    LIMIT :limit)

-- name: claim_candidates
-- Due rows of one limited queue in claim order; $RESCUED makes the fresh and the suspect
-- variants. Jobs whose key already runs at its limit, and job types out of rate-limit
-- room (:blocked, a JSON list), are left out here, so they never fill the lookahead and
-- hold claimable jobs behind them; so are, when the claim reads again, the keys it filled
-- (:full) and the rows it chose (:taken).
SELECT id, name, concurrency_key, concurrency_limit, rate_limit, rate_period
FROM errands_jobs AS j
WHERE state IN ('available', 'scheduled', 'retryable')
  AND queue = :queue
  AND $RESCUED
  AND run_at <= (julianday('now') - 2440587.5) * 86400.0
  AND name NOT IN (SELECT value FROM json_each(:blocked))
  AND id NOT IN (SELECT value FROM json_each(:taken))
  AND (concurrency_key IS NULL OR concurrency_key NOT IN (SELECT value FROM json_each(:full)))
  AND (:names IS NULL OR name IN (SELECT value FROM json_each(:names)))
  AND (concurrency_key IS NULL
       OR (SELECT count(*) FROM errands_jobs AS r
           WHERE r.state = 'running' AND r.concurrency_key = j.concurrency_key)
          < COALESCE(concurrency_limit, 1))
ORDER BY priority DESC, run_at, id
LIMIT :limit

-- name: running_per_key
SELECT concurrency_key, count(*) FROM errands_jobs
WHERE state = 'running' AND concurrency_key IN (SELECT value FROM json_each(:keys))
GROUP BY concurrency_key

-- name: job_claim_ids
-- The rows a limited claim chose, found by id. `+state` keeps the state index out: with no
-- statistics (errands never runs ANALYZE) SQLite would otherwise walk every pending row of
-- the state index to find a few ids (3.7 ms for 20 rows among 40,000 pending, 0.55 by id).
UPDATE errands_jobs
SET state = 'running',
    attempt = attempt + 1,
    lease_owner = :worker_id,
    lease_token = :token,
    lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 + COALESCE(lease_seconds, :lease_default),
    attempted_at = (julianday('now') - 2440587.5) * 86400.0,
    progress = NULL, progress_message = NULL
WHERE id IN (SELECT value FROM json_each(:ids))
  AND +state IN ('available', 'scheduled', 'retryable')
RETURNING id, name, queue, args, meta, state, priority, attempt, max_attempts, run_at,
          idempotency_key, errors, result, inserted_at, attempted_at, finished_at,
          lease_owner, lease_token, lease_expires_at, rescues, cancel_requested, timeout,
          lease_seconds, discarded_by, discard_reason, parent_id, unique_until,
          progress, progress_message, wait_signal, wait_until, fair_key

-- name: cron_states
SELECT name, last_slot, last_job_id, next_slot, expression, timezone FROM errands_cron
ORDER BY name

-- name: cron_save
INSERT INTO errands_cron (name, expression, timezone, last_slot, last_job_id, next_slot,
                          updated_at)
VALUES (:name, :expression, :timezone, :last_slot, :last_job_id, :next_slot, (julianday('now') - 2440587.5) * 86400.0)
ON CONFLICT (name) DO UPDATE
SET expression = excluded.expression, timezone = excluded.timezone,
    last_slot = CASE WHEN :rewind THEN excluded.last_slot
                     ELSE max(COALESCE(errands_cron.last_slot, 0), excluded.last_slot) END,
    last_job_id = COALESCE(excluded.last_job_id, errands_cron.last_job_id),
    next_slot = excluded.next_slot, updated_at = excluded.updated_at

-- name: job_count_by_queue
-- Jobs in one state per queue, from the (state, queue, id) index alone.
SELECT queue, count(*) FROM errands_jobs WHERE state = :state GROUP BY queue

-- name: job_names
-- Every distinct job name, skipping through the (name, id) index (a loose index scan: one
-- probe per name, not a scan of the table). For suggestions when a filter matched nothing.
WITH RECURSIVE names(name) AS (
    SELECT min(name) FROM errands_jobs
    UNION ALL
    SELECT (SELECT min(j.name) FROM errands_jobs AS j WHERE j.name > names.name)
    FROM names WHERE names.name IS NOT NULL
)
SELECT name FROM names WHERE name IS NOT NULL LIMIT :limit

-- name: queue_forget
-- Only while no job waits in the queue or runs (see the PostgreSQL statement).
DELETE FROM errands_queues WHERE name = :name
  AND NOT EXISTS (SELECT 1 FROM errands_jobs AS j
                  WHERE j.queue = :name
                    AND j.state IN ('scheduled', 'available', 'running', 'retryable',
                                    'waiting'))

-- name: job_suspend
-- ctx.wait_for_signal: the attempt ends without charging it (attempt - 1), lease and slot
-- given back; an operator's cancel while it ran ends it cancelled instead.
-- job_resume_if_signalled follows in the same transaction.
UPDATE errands_jobs
SET state = CASE WHEN cancel_requested = 1 THEN 'cancelled' ELSE 'waiting' END,
    wait_signal = CASE WHEN cancel_requested = 1 THEN NULL ELSE :signal END,
    wait_until = CASE WHEN cancel_requested = 1 OR :timeout IS NULL THEN NULL
                      ELSE (julianday('now') - 2440587.5) * 86400.0 + :timeout END,
    attempt = attempt - 1,
    run_at = (julianday('now') - 2440587.5) * 86400.0,
    finished_at = CASE WHEN cancel_requested = 1 THEN (julianday('now') - 2440587.5) * 86400.0 END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
WHERE id = :id AND lease_token = :token AND state = 'running'
RETURNING id, state, workflow_id

-- name: job_resume_if_signalled
-- A waiting job whose signal is stored becomes available (after a suspension, and after
-- app.signal stored one).
UPDATE errands_jobs
SET state = 'available', run_at = (julianday('now') - 2440587.5) * 86400.0, wait_signal = NULL, wait_until = NULL
WHERE id = :id AND state = 'waiting'
  AND EXISTS (SELECT 1 FROM errands_signals AS s
              WHERE s.job_id = errands_jobs.id AND s.name = errands_jobs.wait_signal)

-- name: signal_insert
INSERT INTO errands_signals (job_id, name, payload, sent_at, sent_by)
VALUES (:job_id, :name, :payload, (julianday('now') - 2440587.5) * 86400.0, :actor)

-- name: signal_get
SELECT payload FROM errands_signals WHERE job_id = :job_id AND name = :name ORDER BY id LIMIT 1

-- name: signals_delete
DELETE FROM errands_signals WHERE job_id = :job_id

-- name: job_list_expired_waits
SELECT id, name, queue, attempt, max_attempts, wait_signal FROM errands_jobs
WHERE state = 'waiting' AND wait_until <= (julianday('now') - 2440587.5) * 86400.0
ORDER BY wait_until
LIMIT :limit

-- name: job_expire_wait
-- A wait past its timeout is a failed attempt (charged now: the suspension was not).
UPDATE errands_jobs
SET state = :state,
    attempt = attempt + 1,
    errors = json_insert(errors, '$[#]', json_set(json(:error), '$.at', (julianday('now') - 2440587.5) * 86400.0)),
    run_at = (julianday('now') - 2440587.5) * 86400.0 + :delay,
    finished_at = CASE WHEN :state = 'dead' THEN (julianday('now') - 2440587.5) * 86400.0 END,
    wait_signal = NULL, wait_until = NULL
WHERE id = :id AND state = 'waiting' AND wait_signal = :signal AND wait_until <= (julianday('now') - 2440587.5) * 86400.0
  AND attempt = :attempt

-- name: job_edit
-- An operator's edit of a pending job, guarded by its state: a running or finished job is
-- never changed (the claim and this write serialise on the row). A new run_at makes the
-- job scheduled or available by it (a retryable job stays retryable). The keys are
-- written when the App derived them anew (:keys), the concurrency key with its limit, and
-- the job type's rate, from the same App's code, as an enqueue stores them.
UPDATE errands_jobs
SET run_at = CASE WHEN :set_run_at = 1 THEN COALESCE(:run_at, (julianday('now') - 2440587.5) * 86400.0 + :delay) ELSE run_at END,
    state = CASE WHEN :set_run_at = 1 AND state <> 'retryable'
                 THEN CASE WHEN COALESCE(:run_at, (julianday('now') - 2440587.5) * 86400.0 + :delay) > (julianday('now') - 2440587.5) * 86400.0 + 0.0005
                           THEN 'scheduled' ELSE 'available' END
                 ELSE state END,
    priority = COALESCE(:priority, priority),
    queue = COALESCE(:queue, queue),
    args = COALESCE(:args, args),
    concurrency_key = CASE WHEN :keys THEN :concurrency_key ELSE concurrency_key END,
    concurrency_limit = CASE WHEN :keys THEN :concurrency_limit ELSE concurrency_limit END,
    rate_limit = CASE WHEN :keys THEN :rate_limit ELSE rate_limit END,
    rate_period = CASE WHEN :keys THEN :rate_period ELSE rate_period END,
    fair_key = CASE WHEN :keys THEN :fair_key ELSE fair_key END
WHERE id = :id AND state IN ('scheduled', 'available', 'retryable')

-- name: fair_fold_upsert
-- Not run alone: the end of fair_fold and fair_fold_many (errands.backends.sqlite.
-- statements adds it), which fold attempts into their keys' usage, decayed by the
-- half-life :half_life.
ON CONFLICT (queue, key) DO UPDATE
SET usage = usage * pow(0.5, max(excluded.at - at, 0) / :half_life) + excluded.usage,
    recent = recent * pow(0.5, max(excluded.at - at, 0) / :half_life) + excluded.recent,
    at = excluded.at,
    last_started = max(last_started, excluded.last_started),
    seconds_total = seconds_total + excluded.seconds_total,
    dwell_total = dwell_total + excluded.dwell_total,
    attempts = attempts + excluded.attempts

-- name: fair_fold
-- The worker time of an attempt that ends, folded into its key's usage (decayed by the
-- half-life :half_life), with its dwell (due -> start). Runs in the transaction of the
-- fenced write that ends the attempt, just before it and under the same fence (:expired:
-- the rescue's extra conditions, with the state it plans, :rescue), so it counts exactly
-- the attempts that write ends (a rescue refused for a cancel folded, then folded again). No
-- claim writes here: only the end of an attempt. It counts the seconds the handler ran
-- (:ran, the worker's clock) when the write carries them, else those from claim to now.
INSERT INTO errands_fair_usage (queue, key, usage, recent, at, last_started, seconds_total,
                                dwell_total, attempts)
SELECT queue, fair_key, max(coalesce(:ran, t - attempted_at), 0), 1, t, attempted_at,
       max(coalesce(:ran, t - attempted_at), 0), max(attempted_at - run_at, 0), 1
FROM errands_jobs, (SELECT (julianday('now') - 2440587.5) * 86400.0 AS t)
WHERE id = :id AND lease_token = :token AND state = 'running' AND fair_key IS NOT NULL
  AND (:expired = 0 OR (lease_expires_at < t AND (cancel_requested = 0 OR :rescue = 'cancelled')))

-- name: fair_fold_many
-- fair_fold for a batch of attempts that end (job_finish_many): :outcomes, a JSON array of
-- [id, lease token, seconds the handler ran or null], folded in one statement, one row per
-- key, before the batch's fenced writes and under the same fence (the lease token, the
-- row still running), so it counts exactly the attempts they end (each outcome once: the
-- caller sends each (id, token) once). One upsert per job took a fair queue's
-- completions 58 us a job against 44 without it.
INSERT INTO errands_fair_usage (queue, key, usage, recent, at, last_started, seconds_total,
                                dwell_total, attempts)
SELECT j.queue, j.fair_key, sum(max(coalesce(o.ran, now.t - j.attempted_at), 0)), count(*),
       now.t, max(j.attempted_at), sum(max(coalesce(o.ran, now.t - j.attempted_at), 0)),
       sum(max(j.attempted_at - j.run_at, 0)), count(*)
FROM (SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS token,
             json_extract(value, '$[2]') AS ran
      FROM json_each(:outcomes)) AS o
-- the outcomes first, each row then found by its id (CROSS JOIN keeps SQLite's order: it
-- read every running row through its index, once per outcome, 1.4 ms a job)
CROSS JOIN errands_jobs AS j
CROSS JOIN (SELECT (julianday('now') - 2440587.5) * 86400.0 AS t) AS now
WHERE j.id = o.id AND j.lease_token = o.token AND j.state = 'running'
  AND j.fair_key IS NOT NULL
GROUP BY j.queue, j.fair_key

-- name: fair_heads
-- A fair queue's due rows, per (key, priority level), for at most :limit keys in key
-- order: those after :after (from the first key when NULL) and, when :before is not NULL,
-- up to it (the rotation's wrap). Each key's levels are found by skipping through
-- errands_jobs_fair (one probe per key and level); each level gives its first :per_key
-- rows in (run_at, id) order. A key read whose rows are none due now comes once with NULLs
-- (the rotation moves past it). Rows of a busy concurrency key, or of a job type out of
-- rate room (:blocked), are left out. Rescued rows (suspects) come with the fresh ones
-- when :suspects, marked: see _pick_fair. Each row also carries its key's standing (the
-- columns of fair_states), so a claim reads its window's keys in one statement.
WITH RECURSIVE now(t) AS (SELECT (julianday('now') - 2440587.5) * 86400.0),
levels(key, priority, n) AS (
    SELECT fair_key, priority, 1 FROM errands_jobs
    WHERE id = COALESCE(
        (SELECT id FROM errands_jobs
         WHERE :after IS NULL AND queue = :queue AND state IN ('available', 'scheduled', 'retryable')
           AND fair_key IS NOT NULL
         ORDER BY fair_key, priority LIMIT 1),
        (SELECT id FROM errands_jobs
         WHERE queue = :queue AND state IN ('available', 'scheduled', 'retryable')
           AND fair_key > :after
         ORDER BY fair_key, priority LIMIT 1))
      AND (:before IS NULL OR fair_key <= :before)
    UNION ALL
    SELECT n.fair_key, n.priority, l.n + (n.fair_key <> l.key)
    FROM levels AS l
    -- the key's next level, else the next key's first: two index seeks (a row-value
    -- comparison would scan the rest of the key's level)
    JOIN errands_jobs AS n ON n.id = COALESCE(
        (SELECT id FROM errands_jobs
         WHERE queue = :queue AND state IN ('available', 'scheduled', 'retryable')
           AND fair_key = l.key AND priority > l.priority
         ORDER BY priority LIMIT 1),
        (SELECT id FROM errands_jobs
         WHERE l.n < :limit AND queue = :queue AND state IN ('available', 'scheduled', 'retryable')
           AND fair_key > l.key
         ORDER BY fair_key, priority LIMIT 1))
    WHERE :before IS NULL OR n.fair_key <= :before
),
-- the window's running rows, its keys' only (one probe per key): every running row of
-- the queue was read at each claim, 6 ms a claim with 15,000 running (prefetched jobs
-- are running rows: a few workers of deep prefetch hold thousands)
running AS MATERIALIZED (
    SELECT r.fair_key AS key, sum(max(now.t - r.attempted_at, 0)) AS seconds,
           max(r.attempted_at) AS latest, count(*) AS n
    FROM errands_jobs AS r, now
    WHERE r.queue = :queue AND r.state = 'running'
      -- (implies fair_key IS NOT NULL, the index's predicate; written out, SQLite read
      -- the index's whole range for it and tested the keys after)
      AND r.fair_key IN (SELECT key FROM levels)
    GROUP BY r.fair_key
)
SELECT j.id, j.name, j.concurrency_key, j.concurrency_limit, j.rate_limit, j.rate_period,
       l.key, j.priority, j.run_at, j.rescues > 0,
       -- the key's standing, as fair_states gives it
       u.usage, u.recent, u.at, u.last_started, r.seconds, r.latest, w.weight, now.t, r.n
FROM levels AS l
CROSS JOIN now
LEFT JOIN errands_fair_usage AS u ON u.queue = :queue AND u.key = l.key
LEFT JOIN errands_fair_weights AS w ON w.key = l.key
LEFT JOIN running AS r ON r.key = l.key
LEFT JOIN errands_jobs AS j ON j.id IN (
    SELECT c.id FROM errands_jobs AS c
    WHERE c.queue = :queue AND c.state IN ('available', 'scheduled', 'retryable')
      AND c.fair_key = l.key AND c.priority = l.priority
      AND c.run_at <= (julianday('now') - 2440587.5) * 86400.0
      AND (:suspects = 1 OR c.rescues = 0)
      AND c.name NOT IN (SELECT value FROM json_each(:blocked))
      AND (:names IS NULL OR c.name IN (SELECT value FROM json_each(:names)))
      AND (c.concurrency_key IS NULL
           OR (SELECT count(*) FROM errands_jobs AS r
               WHERE r.state = 'running' AND r.concurrency_key = c.concurrency_key)
              < COALESCE(c.concurrency_limit, 1))
    ORDER BY c.run_at, c.id
    LIMIT :per_key)
ORDER BY l.n, l.priority, j.run_at, j.id

-- name: fair_more
-- The first :per_key due rows of each level of the keys of :keys (a JSON list; a claim
-- with more room than keys reads more of each): the same rows as fair_heads, for those
-- keys only.
WITH RECURSIVE levels(key, priority) AS (
    SELECT k.value, (SELECT priority FROM errands_jobs
                     WHERE queue = :queue AND state IN ('available', 'scheduled', 'retryable')
                       AND fair_key = k.value
                     ORDER BY priority LIMIT 1)
    FROM json_each(:keys) AS k
    UNION ALL
    SELECT l.key, (SELECT priority FROM errands_jobs
                   WHERE queue = :queue AND state IN ('available', 'scheduled', 'retryable')
                     AND fair_key = l.key AND priority > l.priority
                   ORDER BY priority LIMIT 1)
    FROM levels AS l
    WHERE l.priority IS NOT NULL
)
SELECT j.id, j.name, j.concurrency_key, j.concurrency_limit, j.rate_limit, j.rate_period,
       j.fair_key, j.priority, j.run_at, j.rescues > 0
FROM levels AS l
JOIN errands_jobs AS j ON j.id IN (
    SELECT c.id FROM errands_jobs AS c
    WHERE c.queue = :queue AND c.state IN ('available', 'scheduled', 'retryable')
      AND c.fair_key = l.key AND c.priority = l.priority
      AND c.run_at <= (julianday('now') - 2440587.5) * 86400.0
      AND (:suspects = 1 OR c.rescues = 0)
      AND c.name NOT IN (SELECT value FROM json_each(:blocked))
      AND (:names IS NULL OR c.name IN (SELECT value FROM json_each(:names)))
      AND (c.concurrency_key IS NULL
           OR (SELECT count(*) FROM errands_jobs AS r
               WHERE r.state = 'running' AND r.concurrency_key = c.concurrency_key)
              < COALESCE(c.concurrency_limit, 1))
    ORDER BY c.run_at, c.id
    LIMIT :per_key)
WHERE l.priority IS NOT NULL

-- name: fair_lookahead
-- A fair queue's first due rows in claim order (priority, due time, id): the rows without a
-- fair key (enqueued by code that gave them none, which share one key: no index finds them
-- apart from the keyed ones, so the read stays bounded), and the keyed rows of a priority
-- above `above` (NULL: none), which a windowed claim needs (see _pick_fair).
SELECT id, name, concurrency_key, concurrency_limit, rate_limit, rate_period, fair_key,
       priority, run_at, rescues > 0
FROM (SELECT * FROM errands_jobs
      WHERE queue = :queue AND state IN ('available', 'scheduled', 'retryable')
        AND run_at <= (julianday('now') - 2440587.5) * 86400.0
        AND (:suspects = 1 OR rescues = 0)
      ORDER BY priority DESC, run_at, id
      LIMIT :lookahead)
WHERE (fair_key IS NULL OR priority > :above)
  AND (:names IS NULL OR name IN (SELECT value FROM json_each(:names)))

-- name: fair_states
-- Per key of :keys (a JSON list) in a queue: its folded usage (usage, recent attempts,
-- when folded, last start), the seconds its running attempts have used so far, their
-- latest start, its weight, the database's now, and how many attempts run.
-- The running rows of those keys are read once, grouped by key (errands_jobs_fair_running).
WITH now(t) AS (SELECT (julianday('now') - 2440587.5) * 86400.0),
running AS MATERIALIZED (
    SELECT r.fair_key AS key, sum(max(now.t - r.attempted_at, 0)) AS seconds,
           max(r.attempted_at) AS latest, count(*) AS n
    FROM errands_jobs AS r, now
    WHERE r.queue = :queue AND r.state = 'running'
      AND r.fair_key IN (SELECT value FROM json_each(:keys))
    GROUP BY r.fair_key
)
SELECT k.value, u.usage, u.recent, u.at, u.last_started, r.seconds, r.latest, w.weight, now.t,
       r.n
FROM json_each(:keys) AS k
CROSS JOIN now
LEFT JOIN errands_fair_usage AS u ON u.queue = :queue AND u.key = k.value
LEFT JOIN running AS r ON r.key = k.value
LEFT JOIN errands_fair_weights AS w ON w.key = k.value

-- name: fair_weight_set
INSERT INTO errands_fair_weights (key, weight, updated_at, updated_by)
VALUES (:key, :weight, (julianday('now') - 2440587.5) * 86400.0, :actor)
ON CONFLICT (key) DO UPDATE
SET weight = excluded.weight, updated_at = excluded.updated_at, updated_by = excluded.updated_by

-- name: fair_weight_delete
DELETE FROM errands_fair_weights WHERE key = :key

-- name: fair_weights_list
SELECT key, weight, updated_at, updated_by FROM errands_fair_weights ORDER BY key

-- name: fair_usage_list
-- Per key of a queue: worker seconds (decayed, and in all), attempts, dwell in all, the
-- attempts running now, and the jobs due now.
WITH now(t) AS (SELECT (julianday('now') - 2440587.5) * 86400.0),
keys(key) AS (
    SELECT key FROM errands_fair_usage WHERE queue = :queue
    UNION
    SELECT fair_key FROM errands_jobs
    WHERE queue = :queue AND state = 'running' AND fair_key IS NOT NULL
    UNION
    SELECT fair_key FROM errands_jobs
    WHERE queue = :queue AND state IN ('available', 'scheduled', 'retryable')
      AND fair_key IS NOT NULL
)
SELECT keys.key,
       COALESCE(u.usage * pow(0.5, max(now.t - u.at, 0) / :half_life), 0)
         + COALESCE((SELECT sum(max(now.t - r.attempted_at, 0)) FROM errands_jobs AS r
                     WHERE r.queue = :queue AND r.fair_key = keys.key AND r.state = 'running'), 0),
       COALESCE(u.seconds_total, 0), COALESCE(u.attempts, 0), COALESCE(u.dwell_total, 0),
       (SELECT count(*) FROM errands_jobs AS r
        WHERE r.queue = :queue AND r.fair_key = keys.key AND r.state = 'running'),
       (SELECT count(*) FROM errands_jobs AS p
        WHERE p.queue = :queue AND p.fair_key = keys.key
          AND p.state IN ('available', 'scheduled', 'retryable') AND p.run_at <= now.t),
       COALESCE(w.weight, 1.0)
FROM keys CROSS JOIN now
LEFT JOIN errands_fair_usage AS u ON u.queue = :queue AND u.key = keys.key
LEFT JOIN errands_fair_weights AS w ON w.key = keys.key
ORDER BY keys.key

-- All SQL of the PostgreSQL backend, with the same query names as the SQLite backend.
-- Markers, filled once by the loader: {schema} (the quoted schema name) and {job_columns}
-- (the JobRow column list over alias j, times as epoch seconds). Parameters are psycopg's
-- %(name)s placeholders, always bound, never formatted. Batches travel as arrays through
-- unnest(), so one round trip carries a whole batch; the hot path's arrays are bound in
-- binary (%(name)b: psycopg dumps a list ~2.5 x faster so; every element of one array
-- must then be of one Python type, so the backend passes floats as float).

-- name: job_insert
-- One round trip: insert and, when this process has not notified the queue within its
-- window (channel not null), NOTIFY in the same statement; id is NULL when deduplicated.
WITH ins AS (
INSERT INTO {schema}.errands_jobs AS j
    (name, queue, args, meta, state, priority, max_attempts, run_at, idempotency_key,
     timeout, lease_seconds, parent_id, unique_until, concurrency_key, concurrency_limit,
     rate_limit, rate_period, fair_key)
VALUES (%(name)s, %(queue)s, %(args)s::jsonb, %(meta)s::jsonb,
        CASE WHEN COALESCE(to_timestamp(%(run_at)s), now() + make_interval(secs => %(delay)s))
                  > now() THEN 'scheduled' ELSE 'available' END,
        %(priority)s, %(max_attempts)s,
        COALESCE(to_timestamp(%(run_at)s), now() + make_interval(secs => %(delay)s)),
        %(key)s, %(timeout)s, %(lease_seconds)s, %(parent_id)s,
        now() + make_interval(secs => %(unique_for)s), %(concurrency_key)s,
        %(concurrency_limit)s, %(rate_limit)s, %(rate_period)s, %(fair_key)s)
ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING j.id
), note AS (
    SELECT pg_notify(%(channel)s::text, %(queue)s)
    WHERE %(channel)s::text IS NOT NULL AND EXISTS (SELECT 1 FROM ins)
)
SELECT (SELECT id FROM ins), (SELECT count(*) FROM note)

-- name: job_insert_many
-- ids are allocated first (job_allocate_ids) so results map back to requests by id. The
-- rows go in in the order of the unique index errands_jobs_key (name, key; rows without a
-- key last): each keyed row takes its key's lock there (held to the transaction's end,
-- and waited for while another transaction holds the key uncommitted), so two batches
-- always take their common keys in the same order. In the caller's order, two batches
-- holding overlapping keys in opposite orders deadlocked.
INSERT INTO {schema}.errands_jobs AS j
    (id, name, queue, args, meta, state, priority, max_attempts, run_at, idempotency_key,
     timeout, lease_seconds, parent_id, unique_until, concurrency_key, concurrency_limit,
     rate_limit, rate_period, fair_key)
SELECT r.id, r.name, r.queue, r.args::jsonb, r.meta::jsonb,
       CASE WHEN COALESCE(to_timestamp(r.run_at), now() + make_interval(secs => r.delay))
                 > now() THEN 'scheduled' ELSE 'available' END,
       r.priority, r.max_attempts,
       COALESCE(to_timestamp(r.run_at), now() + make_interval(secs => r.delay)),
       r.key, r.timeout, r.lease_seconds, r.parent_id,
       now() + make_interval(secs => r.unique_for), r.concurrency_key, r.concurrency_limit,
       r.rate_limit, r.rate_period, r.fair_key
FROM unnest(%(ids)s::bigint[], %(names)s::text[], %(queues)s::text[], %(args)s::text[],
            %(metas)s::text[], %(priorities)s::int[], %(max_attempts)s::int[],
            %(run_ats)s::float8[], %(delays)s::float8[], %(keys)s::text[],
            %(timeouts)s::float8[], %(leases)s::float8[], %(parents)s::bigint[],
            %(unique_fors)s::float8[], %(ckeys)s::text[], %(climits)s::int[],
            %(rlimits)s::int[], %(rperiods)s::float8[], %(fkeys)s::text[])
     AS r(id, name, queue, args, meta, priority, max_attempts, run_at, delay, key, timeout,
          lease_seconds, parent_id, unique_for, concurrency_key, concurrency_limit,
          rate_limit, rate_period, fair_key)
ORDER BY r.name, r.key, r.id
ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING j.id

-- name: job_allocate_ids
-- ids in order (one array), and the transaction's now() that the rows' times are computed
-- from. The sequence is looked up once (MATERIALIZED), not once per id: 4x faster.
WITH s AS MATERIALIZED (
    SELECT pg_get_serial_sequence('{schema}.errands_jobs', 'id')::regclass AS seq
)
SELECT array_agg(nextval(s.seq)), now()
FROM s CROSS JOIN generate_series(1, %(n)s)

-- name: job_copy
-- Bulk enqueue of jobs without idempotency keys (no conflict to handle): the rows are
-- written by the backend with ids from job_allocate_ids and times computed from its now().
-- The backend names the columns (COPY_REQUIRED and COPY_OPTIONAL in backend.py): those
-- every job sets, plus each optional one some job of the batch sets; the rest keep their
-- defaults (NULL, priority 0, an empty meta), and fewer columns are less to send and parse.
COPY {schema}.errands_jobs ({{columns}}) FROM STDIN

-- name: job_expire_keys
-- unique_for: the keys (names[i], keys[i]) whose holder's period is over are released
-- (kept in meta as expired_key), all in one statement; the keys released. Run only for
-- keys an insert found taken; those inserts are then tried again. The holders are locked
-- in the unique index's order (name, key), as job_insert_many takes keys, so two callers
-- never wait for each other in a cycle. A holder another caller released or deleted
-- meanwhile is left out (its row is checked again once locked).
WITH expired AS (
    SELECT j.id, j.name, j.idempotency_key AS key
    FROM {schema}.errands_jobs j
    JOIN unnest(%(names)s::text[], %(keys)s::text[]) AS k(name, key)
      ON j.name = k.name AND j.idempotency_key = k.key
    WHERE j.unique_until IS NOT NULL AND j.unique_until <= now()
    ORDER BY j.name, j.idempotency_key
    FOR UPDATE OF j
)
UPDATE {schema}.errands_jobs AS j
SET meta = j.meta || jsonb_build_object('expired_key', e.key), idempotency_key = NULL
FROM expired e
WHERE j.id = e.id
RETURNING e.name, e.key

-- name: job_ids_by_keys
-- The jobs holding the keys (names[i], keys[i]): each one's name, key and id.
SELECT j.name, j.idempotency_key, j.id
FROM {schema}.errands_jobs j
JOIN unnest(%(names)s::text[], %(keys)s::text[]) AS k(name, key)
  ON j.name = k.name AND j.idempotency_key = k.key

-- name: job_claim
-- One statement for every queue: each queue's due rows in claim order, up to its cap,
-- locked with SKIP LOCKED so concurrent claimers never wait on each other's rows.
-- $RESCUED makes two variants (see errands.backends.sqlfile): job_claim takes fresh rows
-- (rescues = 0), job_claim_suspect rescued ones (rescues > 0, through their own partial
-- index). Rows carrying a limit (a concurrency key or a rate) are never taken here: the
-- worker claims them through claim_limited, which counts them (errands.backends.limits).
-- The job types the worker runs (names) are tested by array_position, which no index can
-- serve and which the planner does not count as selective: as `name = ANY(names)`, a job
-- type the statistics had not seen was estimated at one row, and the claim read every
-- due row of it through errands_jobs_state_name (before schema version 16, which left
-- available rows out of that index) and sorted them, for 40 (every claim
-- statement does the same; tests/postgres/test_claim_plans.py).
-- A queue whose stored settings limit it (another deployment's max_running, rate or
-- fairness) is never claimed here either: a worker that has not learnt it yet (its
-- refresh, a poll interval; at start or while the store erred) claimed it past them.
WITH picked AS (
    SELECT p.id
    FROM unnest(%(queues)s::text[], %(limits)s::int[]) AS q(name, cap)
    CROSS JOIN LATERAL (
        SELECT id FROM {schema}.errands_jobs
        WHERE state IN ('available', 'scheduled', 'retryable')
          AND queue = q.name
          AND run_at <= now()
          AND $RESCUED
          AND concurrency_key IS NULL AND rate_limit IS NULL
          AND (%(names)s::text[] IS NULL OR array_position(%(names)s::text[], name) IS NOT NULL)
          AND NOT EXISTS (SELECT 1 FROM {schema}.errands_queues s
                          WHERE s.name = q.name
                            AND (s.paused OR s.max_running IS NOT NULL
                                 OR s.rate_limit IS NOT NULL OR s.fair OR s.aging IS NOT NULL))
        ORDER BY priority DESC, run_at, id
        LIMIT q.cap
        FOR UPDATE SKIP LOCKED
    ) AS p
    LIMIT %(limit)s
)
UPDATE {schema}.errands_jobs AS j
SET state = 'running',
    attempt = j.attempt + 1,
    lease_owner = %(worker_id)s,
    lease_token = %(token)s,
    lease_expires_at = now() + make_interval(secs => COALESCE(j.lease_seconds, %(lease_default)s)),
    attempted_at = now(),
    progress = NULL, progress_message = NULL
-- The picked rows by primary key, one probe each: joined as `FROM picked WHERE j.id =
-- picked.id`, a claim of 1,000 rows from a table of 20,000 to 50,000 was planned as a
-- hash join over a sequential read of the whole table (23.7 -> 18.9 ms a claim at
-- 20,000 rows, 31.3 -> 18.9 at 50,000). The rows come back in no set order either way
-- (the worker sorts them).
WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING {job_columns}

-- name: job_finish_many
-- A cancel requested while the job ran turns a failure (retry or dead) into 'cancelled':
-- it never runs again, and an operator's cancel is not reported as a dead job. The ended
-- attempts of fair keys are folded into their usage in the same statement (fair_fold_cte).
-- Attempts' writes (job_finish_many, job_complete_many, job_heartbeat_many,
-- job_release_many, job_rescue_many) find their rows by id, one index probe each, whatever
-- the statistics say. Each reads its input from a subquery the planner cannot flatten
-- (OFFSET 0) and tests the row's state against it (o.was, o.members, o.now): join
-- conditions, never restrictions of errands_jobs alone. As restrictions (j.state =
-- 'running' AND j.workflow_id IS NULL), a table without statistics (a fresh or bulk-
-- loaded table before autovacuum's ANALYZE), or analysed while nothing ran, made the
-- planner expect one running row: it read every running row and compared each with the
-- whole batch, 150-480 ms for a batch of 500 completions beside 2,000 running jobs,
-- 2,000 jobs/s where the worker does 16,000 (tests/postgres/test_write_plans.py).
WITH ended AS (
UPDATE {schema}.errands_jobs AS j
SET state = CASE WHEN j.cancel_requested AND o.state IN ('retryable', 'dead')
                 THEN 'cancelled' ELSE o.state END,
    result = o.result::jsonb,
    errors = CASE WHEN o.error IS NULL THEN j.errors
                  ELSE j.errors || jsonb_build_array(
                       o.error::jsonb || jsonb_build_object('at', extract(epoch FROM now())))
             END,
    run_at = CASE WHEN o.state = 'retryable'
                  THEN now() + make_interval(secs => o.delay) ELSE j.run_at END,
    finished_at = CASE WHEN o.state = 'retryable' AND NOT j.cancel_requested THEN NULL
                       ELSE now() END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
FROM (SELECT o.*, 'running'::text AS was, %(members)s::boolean AS members
      FROM unnest(%(ids)b::bigint[], %(tokens)b::text[], %(states)b::text[],
                  %(results)b::text[], %(errors)b::text[], %(delays)b::float8[],
                  %(rans)b::float8[]) AS o(id, token, state, result, error, delay, ran)
      OFFSET 0) AS o
WHERE j.id = o.id AND j.lease_token = o.token AND j.state = o.was
  AND (j.workflow_id IS NOT NULL) = o.members
RETURNING j.id, o.token, j.state, j.queue AS f_queue, j.fair_key AS f_key,
          j.attempted_at AS f_started, o.ran AS f_ran, {fair_due}
), {fair_fold}, {notify_ended}
SELECT id, token, state FROM ended CROSS JOIN notified

-- name: job_complete_many
-- job_complete_many: job_finish_many for a batch of completions only, of jobs outside
-- workflows (the usual batch under a backlog): the same write, with four arrays instead
-- of seven and none of a failure's cases (a sixth of the statement's time on the server,
-- batches of 134 rows). A cancel requested while the job ran leaves a completion as it
-- is, as in job_finish_many. The attempts of fair keys are folded as there; a completion
-- leaves run_at as it was, so the due time is the row's own (job_finish_many reads it
-- again for each row, as its retries move it).
WITH ended AS (
UPDATE {schema}.errands_jobs AS j
SET state = 'completed',
    result = o.result::jsonb,
    finished_at = now(),
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
-- (by id, whatever the statistics say: see job_finish_many)
FROM (SELECT o.*, 'running'::text AS was, false AS members
      FROM unnest(%(ids)b::bigint[], %(tokens)b::text[], %(results)b::text[],
                  %(rans)b::float8[]) AS o(id, token, result, ran)
      OFFSET 0) AS o
WHERE j.id = o.id AND j.lease_token = o.token AND j.state = o.was
  AND (j.workflow_id IS NOT NULL) = o.members
RETURNING j.id, o.token, j.state, j.queue AS f_queue, j.fair_key AS f_key,
          j.attempted_at AS f_started, o.ran AS f_ran, j.run_at AS f_due
), {fair_fold}, {notify_ended}
SELECT id, token, state FROM ended CROSS JOIN notified

-- name: job_heartbeat_many
-- The handlers' latest ctx.progress rides on the heartbeat (NULL: unchanged).
UPDATE {schema}.errands_jobs AS j
SET lease_expires_at = now() + make_interval(secs => o.lease_seconds),
    progress = COALESCE(o.progress, j.progress),
    progress_message = CASE WHEN o.progress IS NULL THEN j.progress_message ELSE o.message END
-- (by id, whatever the statistics say: see job_finish_many)
FROM (SELECT o.*, 'running'::text AS was
      FROM unnest(%(ids)b::bigint[], %(tokens)b::text[], %(leases)b::float8[],
                  %(progress)s::float8[], %(messages)s::text[])
           AS o(id, token, lease_seconds, progress, message)
      OFFSET 0) AS o
WHERE j.id = o.id AND j.lease_token = o.token AND j.state = o.was
RETURNING j.id, j.lease_token, j.cancel_requested

-- name: job_release_many
-- Shutdown: the attempt is given back uncharged (attempt - 1), and recorded in errors with
-- kind 'released', its attempt number and lease token, so the run that follows is
-- explained (I4). %(unrun)s (their handlers never ran: no child process could start for
-- them): a release like the job's last entry (the same attempt, the same message) is
-- counted in that entry ('times'; its worker, token and time the latest) rather than
-- appended: a job released every 30 s for a cause that lasts grew its errors by ~2,880
-- entries a day. %(prefetched)s (claimed, never begun): nothing is recorded and the job
-- keeps its run_at (due again in its place), as if never claimed (the caller sends the
-- plain statement: nothing folded). Fair keys' usage is folded in the same statement.
-- %(delays)s: a pause before each job is due again (its run_at now + delay; 'retryable'
-- while it waits, as after a backoff): a job whose ctx.transaction() met a store that
-- cannot write is given back with a growing pause (it was due at once, and ran again in a
-- tight loop for as long as the store could not write).
WITH ended AS (
UPDATE {schema}.errands_jobs AS j
SET state = CASE WHEN j.cancel_requested THEN 'cancelled'
                 WHEN o.delay > 0 AND NOT %(prefetched)s::boolean THEN 'retryable'
                 ELSE 'available' END,
    errors = CASE
        WHEN %(prefetched)s::boolean THEN j.errors
        WHEN %(unrun)s::boolean AND j.errors -> -1 ->> 'kind' = 'released'
         AND j.errors -> -1 ->> 'message' = %(message)s::text
         AND j.errors -> -1 -> 'attempt' = to_jsonb(j.attempt)
        THEN jsonb_set(j.errors, ARRAY['-1'], (j.errors -> -1) || jsonb_build_object(
            'times', coalesce((j.errors -> -1 ->> 'times')::int, 1) + 1,
            'worker', j.lease_owner, 'lease_token', j.lease_token,
            'at', extract(epoch FROM now())))
        ELSE j.errors || jsonb_build_array(jsonb_build_object(
            'attempt', j.attempt, 'type', 'Released', 'message', %(message)s::text,
            'traceback', NULL, 'worker', j.lease_owner, 'kind', 'released',
            'lease_token', j.lease_token, 'at', extract(epoch FROM now())))
    END,
    attempt = j.attempt - 1,
    run_at = CASE WHEN %(prefetched)s::boolean THEN j.run_at
                  ELSE now() + make_interval(secs => o.delay) END,
    finished_at = CASE WHEN j.cancel_requested THEN now() END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
-- (by id, whatever the statistics say: see job_finish_many)
FROM (SELECT o.*, 'running'::text AS was
      FROM unnest(%(ids)b::bigint[], %(tokens)b::text[], %(delays)b::float8[])
           AS o(id, token, delay)
      OFFSET 0) AS o
WHERE j.id = o.id AND j.lease_token = o.token AND j.state = o.was
RETURNING j.id, j.workflow_id, j.state, j.queue AS f_queue, j.fair_key AS f_key,
          j.attempted_at AS f_started, NULL::float8 AS f_ran, {fair_due}
), {fair_fold}, {notify_ended}
SELECT id, workflow_id, state FROM ended CROSS JOIN notified

-- name: job_claim_undo
-- A claim whose reply was lost (its connection broke once its write or its COMMIT was
-- sent: it may have committed, and the worker never learnt which jobs it took), undone
-- by its lease token: each job it took and still holds is due again as it was, in its
-- place in the queue (run_at as it was), the attempt not charged, nothing recorded on
-- the job (no handler ran: neither a release nor a rescue) and no worker time folded into
-- its fair key's usage. The starts the claim logged against rates go with it (its rows
-- of errands_rate_log); a concurrency key's and a queue's running counts are read from
-- the running rows, so they free up with them. A cancel requested meanwhile ends the job
-- cancelled, as a release does. attempted_at keeps the undone claim's time. A rare
-- statement: it reads the running rows and the rate log whole (a window's rows a bucket).
-- Each row's queue comes back so the caller can NOTIFY the queues of the jobs due again.
WITH starts AS (
    DELETE FROM {schema}.errands_rate_log WHERE token = ANY(%(tokens)s::text[])
), ended AS (
UPDATE {schema}.errands_jobs AS j
SET state = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'available' END,
    attempt = j.attempt - 1,
    finished_at = CASE WHEN j.cancel_requested THEN now() ELSE j.finished_at END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
WHERE j.lease_token = ANY(%(tokens)s::text[]) AND j.state = 'running'
RETURNING j.id, j.workflow_id, j.state, j.queue
), {notify_ended}
SELECT id, workflow_id, state, queue FROM ended CROSS JOIN notified

-- name: leader_attempt_elect
INSERT INTO {schema}.errands_leaders AS l (name, owner, elected_at, expires_at)
VALUES (%(name)s, %(owner)s, now(), now() + make_interval(secs => %(ttl)s))
ON CONFLICT (name) DO UPDATE
SET owner = excluded.owner,
    elected_at = CASE WHEN l.owner = excluded.owner THEN l.elected_at ELSE excluded.elected_at END,
    expires_at = excluded.expires_at
WHERE l.owner = excluded.owner OR l.expires_at < now()
RETURNING l.owner

-- name: leader_resign
DELETE FROM {schema}.errands_leaders WHERE name = %(name)s AND owner = %(owner)s

-- name: job_list_expired
SELECT id, name, queue, lease_token, attempt, max_attempts, rescues, cancel_requested,
       lease_owner, fair_key IS NOT NULL
FROM {schema}.errands_jobs
WHERE state = 'running' AND lease_expires_at < now()
ORDER BY lease_expires_at
LIMIT %(limit)s

-- name: job_rescue_many
-- Fenced three times: the token must be the expired claim's, the lease must still be
-- expired (a heartbeat that landed in between wins), and a cancel requested since the
-- rescue was planned refuses a plan that is not 'cancelled' (it is planned again, as a
-- cancel: a plan written as cancelled was announced dead, its on_dead hooks due). Fair
-- keys' usage is folded in the same statement.
WITH ended AS (
UPDATE {schema}.errands_jobs AS j
SET state = o.state,
    rescues = j.rescues + 1,
    errors = j.errors || jsonb_build_array(
             o.error::jsonb || jsonb_build_object('at', extract(epoch FROM now()))),
    run_at = now() + make_interval(secs => o.delay),
    finished_at = CASE WHEN o.state <> 'retryable' THEN now() END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
-- (by id, whatever the statistics say: see job_finish_many)
FROM (SELECT o.*, 'running'::text AS was, now() AS now
      FROM unnest(%(ids)s::bigint[], %(tokens)s::text[], %(states)s::text[],
                  %(errors)s::text[], %(delays)s::float8[]) AS o(id, token, state, error, delay)
      OFFSET 0) AS o
WHERE j.id = o.id AND j.lease_token = o.token AND j.state = o.was
  AND j.lease_expires_at < o.now AND (NOT j.cancel_requested OR o.state = 'cancelled')
RETURNING j.id, j.workflow_id, j.state, j.queue AS f_queue, j.fair_key AS f_key,
          j.attempted_at AS f_started, NULL::float8 AS f_ran, {fair_due}
), {fair_fold}, {notify_ended}
SELECT id, workflow_id, state FROM ended CROSS JOIN notified

-- name: job_promote_due
-- At most %(limit)s rows a call (the leader calls again while a batch comes back full): one
-- statement over a million rows due at once held their row locks until it committed (every
-- claim skipped them meanwhile) and outlived the leader's lease. Claims take due scheduled
-- and retryable rows as they are: promotion only relabels them, so it may lag.
UPDATE {schema}.errands_jobs
SET state = 'available'
WHERE id IN (SELECT id FROM {schema}.errands_jobs
             WHERE state IN ('scheduled', 'retryable') AND run_at <= now()
             LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
  AND state IN ('scheduled', 'retryable')

-- name: job_prune
-- Small batches, the steps and the signals of each pruned job with it (its signals were
-- kept for ever: migration 0009 says they go with the job, as SQLite deletes them).
WITH gone AS (
    DELETE FROM {schema}.errands_jobs
    WHERE id IN (
        SELECT id FROM {schema}.errands_jobs AS j
        WHERE state IN ('completed', 'cancelled', 'discarded')
          AND finished_at < now() - make_interval(secs => %(older_than)s)
          -- a workflow's member stays while its workflow does (a dependent yet to run,
          -- the workflow's result and its callbacks read it): pruned, it read as a
          -- completed parent with no result. Workflows go by their outermost one's
          -- settle time (wf_prunable), their members with them.
          AND (j.workflow_id IS NULL
               OR NOT EXISTS (SELECT 1 FROM {schema}.errands_workflows AS w
                              WHERE w.id = j.workflow_id))
        LIMIT %(limit)s
    )
    RETURNING id
), steps AS (
    DELETE FROM {schema}.errands_steps WHERE job_id IN (SELECT id FROM gone)
), signals AS (
    DELETE FROM {schema}.errands_signals WHERE job_id IN (SELECT id FROM gone)
)
SELECT count(*) FROM gone

-- name: steps_delete
DELETE FROM {schema}.errands_steps WHERE job_id = %(job_id)s

-- name: steps_delete_many
DELETE FROM {schema}.errands_steps WHERE job_id = ANY(%(ids)s::bigint[])

-- name: job_get
SELECT {job_columns} FROM {schema}.errands_jobs AS j WHERE j.id = %(id)s

-- name: job_list
-- A queue or a name is compared twice: in the column's collation, for the partial btree
-- indexes (state, queue / name, id), and in "C", for errands_jobs_listing_bloom, which
-- only a comparison in "C" can use (so that no claim ever picks it: migration 15).
SELECT {job_columns}
FROM {schema}.errands_jobs AS j
WHERE (%(state)s::text IS NULL OR j.state = %(state)s::text)
  AND (%(queue)s::text IS NULL
       OR (j.queue = %(queue)s::text AND j.queue COLLATE "C" = %(queue)s::text))
  AND (%(name)s::text IS NULL
       OR (j.name = %(name)s::text AND j.name COLLATE "C" = %(name)s::text))
  AND (%(before_id)s::bigint IS NULL OR j.id < %(before_id)s::bigint)
  AND (%(parent_id)s::bigint IS NULL OR j.parent_id = %(parent_id)s::bigint)
ORDER BY j.id DESC
LIMIT %(limit)s

-- name: job_list_due
-- Available jobs of one queue by priority, then due time, then id (a plain queue's claim
-- order: next first), through errands_jobs_due: available rows are in no listing index
-- (schema version 16), and this order is the one that index keeps. The first page; the
-- next ones: job_list_due_after.
SELECT {job_columns} FROM {schema}.errands_jobs AS j
WHERE j.state IN ('available', 'scheduled', 'retryable') AND j.state = 'available'
  AND j.queue = %(queue)s::text
  AND (%(name)s::text IS NULL OR j.name = %(name)s::text)
  AND (%(parent_id)s::bigint IS NULL OR j.parent_id = %(parent_id)s::bigint)
ORDER BY j.priority DESC, j.run_at, j.id
LIMIT %(limit)s

-- name: job_list_due_after
-- The page of job_list_due after the position (after_priority, after_at: the due time,
-- converted from the cursor's epoch seconds by Python, which recovers the stored
-- microsecond where to_timestamp of the float may miss it by one, after_id) of the
-- previous page's last row (Job.cursor):
-- the values, not the row, which may have been claimed, retried or edited since. The rows
-- after it at its priority, then the lower priorities: two index ranges, hence the
-- filters twice; a page costs what the first costs however long the queue's backlog.
SELECT * FROM (
    SELECT * FROM (
     SELECT {job_columns} FROM {schema}.errands_jobs AS j
     WHERE j.state IN ('available', 'scheduled', 'retryable') AND j.state = 'available'
       AND j.queue = %(queue)s::text
       AND (%(name)s::text IS NULL OR j.name = %(name)s::text)
       AND (%(parent_id)s::bigint IS NULL OR j.parent_id = %(parent_id)s::bigint)
       AND j.priority = %(after_priority)s::int
       AND (j.run_at, j.id) > (%(after_at)s::timestamptz, %(after_id)s::bigint)
     ORDER BY j.run_at, j.id
     LIMIT %(limit)s) AS same_priority
    UNION ALL
    SELECT * FROM (
     SELECT {job_columns} FROM {schema}.errands_jobs AS j
     WHERE j.state IN ('available', 'scheduled', 'retryable') AND j.state = 'available'
       AND j.queue = %(queue)s::text
       AND (%(name)s::text IS NULL OR j.name = %(name)s::text)
       AND (%(parent_id)s::bigint IS NULL OR j.parent_id = %(parent_id)s::bigint)
       AND j.priority < %(after_priority)s::int
     ORDER BY j.priority DESC, j.run_at, j.id
     LIMIT %(limit)s) AS lower_priorities
) AS page
ORDER BY 7 DESC, 10, 1  -- priority, run_at, id
LIMIT %(limit)s

-- name: job_ids_matching
-- A bulk DLQ action's jobs: a plain read, locking nothing (its dry run is only this;
-- job_replay and job_discard lock the rows they change, and skip those no longer dead).
SELECT id FROM {schema}.errands_jobs
WHERE state = %(state)s  -- a queue or a name compared twice: see job_list
  AND (%(queue)s::text IS NULL
       OR (queue = %(queue)s::text AND queue COLLATE "C" = %(queue)s::text))
  AND (%(name)s::text IS NULL
       OR (name = %(name)s::text AND name COLLATE "C" = %(name)s::text))
ORDER BY id

-- name: job_states
SELECT id, state FROM {schema}.errands_jobs WHERE id = ANY(%(ids)s::bigint[])

-- name: job_get_many
SELECT {job_columns} FROM {schema}.errands_jobs AS j WHERE j.id = ANY(%(ids)s::bigint[])

-- name: job_state_for_update
SELECT state FROM {schema}.errands_jobs WHERE id = %(id)s FOR UPDATE

-- name: queue_stats
SELECT queue, state, count(*),
       extract(epoch FROM now() - min(run_at) FILTER (
           WHERE state IN ('available', 'scheduled', 'retryable') AND run_at <= now()))::float8,
       count(*) FILTER (WHERE state = 'running' AND lease_expires_at < now())
FROM {schema}.errands_jobs
GROUP BY queue, state

-- name: job_replay
-- The jobs of %(ids)s still dead back to available, in one statement however many
-- (row by row, 100,000 took a minute in one transaction); their ids and queues. Locked
-- in id order first, as job_discard locks them: two bulk actions wait for each other,
-- never in a cycle. A row changed meanwhile is read again once its lock is free: one no
-- longer dead is left out.
{dead_locked}
UPDATE {schema}.errands_jobs AS j
SET state = 'available', attempt = 0, rescues = 0, cancel_requested = false,
    run_at = now(), finished_at = NULL
FROM dead WHERE j.id = dead.id
RETURNING j.id, j.queue

-- name: job_discard
-- The jobs of %(ids)s still dead to discarded (as job_replay: one statement, locked in
-- id order); their ids and queues.
{dead_locked}
UPDATE {schema}.errands_jobs AS j
SET state = 'discarded', discarded_by = %(actor)s, discard_reason = %(reason)s,
    finished_at = now()
FROM dead WHERE j.id = dead.id
RETURNING j.id, j.queue

-- name: job_cancel_pending
UPDATE {schema}.errands_jobs
SET state = 'cancelled', finished_at = now(), wait_signal = NULL, wait_until = NULL
WHERE id = %(id)s AND state IN ('available', 'scheduled', 'retryable', 'waiting')

-- name: job_cancel_running
UPDATE {schema}.errands_jobs SET cancel_requested = true
WHERE id = %(id)s AND state = 'running'

-- name: audit_insert
INSERT INTO {schema}.errands_audit (actor, action, job_id, detail)
VALUES (%(actor)s, %(action)s, %(job_id)s, %(detail)s::jsonb)

-- name: audit_insert_many
-- One audit row per job of %(ids)s, in their order, all with the same actor, action and
-- detail (a bulk replay or discard).
INSERT INTO {schema}.errands_audit (actor, action, job_id, detail)
SELECT %(actor)s, %(action)s, u.id, %(detail)s::jsonb
FROM unnest(%(ids)s::bigint[]) WITH ORDINALITY AS u(id, n)
ORDER BY u.n

-- name: audit_list
SELECT id, extract(epoch FROM at)::float8, actor, action, job_id, detail::text
FROM {schema}.errands_audit
WHERE (%(job_id)s::bigint IS NULL OR job_id = %(job_id)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s

-- name: db_now
SELECT extract(epoch FROM now())::float8

-- name: notify
SELECT pg_notify(%(channel)s, %(payload)s)

-- name: worker_register
INSERT INTO {schema}.errands_workers (id, host, pid, queues, concurrency, version, jobs,
                                      beat_seconds)
VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s, %(version)s, %(jobs)s,
        %(beat_seconds)s)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), jobs = excluded.jobs,
                               beat_seconds = excluded.beat_seconds

-- name: worker_heartbeat
UPDATE {schema}.errands_workers
SET heartbeat_at = now(), in_flight = %(in_flight)s, processed = %(processed)s
WHERE id = %(id)s

-- name: worker_deregister
DELETE FROM {schema}.errands_workers WHERE id = %(id)s

-- name: worker_list
SELECT id, host, pid, queues, concurrency, extract(epoch FROM started_at)::float8,
       extract(epoch FROM heartbeat_at)::float8, in_flight, processed, version,
       extract(epoch FROM now() - heartbeat_at)::float8, jobs, beat_seconds
FROM {schema}.errands_workers
ORDER BY started_at

-- name: job_count_pending_by_name
-- Due and waiting jobs per job type (for the jobs no live worker can run).
SELECT name, count(*) FROM {schema}.errands_jobs
WHERE state IN ('available', 'scheduled', 'retryable')
GROUP BY name

-- name: worker_prune
-- Silent for older_than, or for ten of its own beats when that is longer (a worker with a
-- 15-minute lease beats every 5 minutes: it was forgotten between two beats).
DELETE FROM {schema}.errands_workers
WHERE heartbeat_at < now() - make_interval(
          secs => GREATEST(%(older_than)s, 10 * COALESCE(beat_seconds, 0)))

-- name: step_list
SELECT job_id, name, result::text, attempt, extract(epoch FROM created_at)::float8
FROM {schema}.errands_steps
WHERE job_id = %(job_id)s
ORDER BY created_at, name

-- name: step_insert
INSERT INTO {schema}.errands_steps (job_id, name, result, attempt)
VALUES (%(job_id)s, %(name)s, %(result)s::jsonb, %(attempt)s)
ON CONFLICT (job_id, name) DO NOTHING

-- name: step_get
SELECT result::text FROM {schema}.errands_steps WHERE job_id = %(job_id)s AND name = %(name)s

-- name: store_health
SELECT t.n_dead_tup, t.n_live_tup,
       (SELECT coalesce(extract(epoch FROM now() - min(a.xact_start)), 0)::float8
        FROM pg_stat_activity a
        WHERE a.datname = current_database() AND a.xact_start IS NOT NULL
          AND a.pid <> pg_backend_pid())
FROM (SELECT 1) AS one
LEFT JOIN pg_stat_user_tables t
       ON t.schemaname = %(schema)s AND t.relname = 'errands_jobs'

-- name: job_throughput
-- Per bucket and queue over the last %(since)s seconds: completed and dead jobs (by
-- finished_at) and failed attempts (by each error's "at"). A job that failed in the window
-- is now pending or running, or finished inside the window, so only those rows are read,
-- each part through an index. The window is written out (no CTE) so the planner estimates
-- it from the statistics: a blind estimate would cost the query a JIT compilation.
WITH candidates AS (
    SELECT j.queue, j.state, j.finished_at, j.errors FROM {schema}.errands_jobs AS j
    WHERE j.state IN ('completed', 'cancelled', 'discarded')
      AND j.finished_at >= now() - make_interval(secs => %(since)s)
    UNION ALL
    SELECT j.queue, j.state, j.finished_at, j.errors FROM {schema}.errands_jobs AS j
    WHERE j.state = 'dead' AND j.finished_at >= now() - make_interval(secs => %(since)s)
    UNION ALL
    SELECT j.queue, j.state, j.finished_at, j.errors FROM {schema}.errands_jobs AS j
    WHERE j.state IN ('available', 'scheduled', 'retryable') AND j.errors <> '[]'::jsonb
    UNION ALL
    SELECT j.queue, j.state, j.finished_at, j.errors FROM {schema}.errands_jobs AS j
    WHERE j.state = 'running' AND j.errors <> '[]'::jsonb
), events AS (
    SELECT queue, state AS kind, extract(epoch FROM finished_at)::float8 AS at
    FROM candidates WHERE state IN ('completed', 'dead')
    UNION ALL
    SELECT c.queue, 'failed', (e ->> 'at')::float8
    FROM candidates AS c CROSS JOIN LATERAL jsonb_array_elements(c.errors) AS e
    WHERE c.errors <> '[]'::jsonb AND (e ->> 'kind') IS DISTINCT FROM 'released'
      AND (e ->> 'at')::float8 >= extract(epoch FROM now())::float8 - %(since)s
)
SELECT (floor(at / %(bucket)s) * %(bucket)s)::float8 AS bucket, queue,
       count(*) FILTER (WHERE kind = 'completed'),
       count(*) FILTER (WHERE kind = 'dead'),
       count(*) FILTER (WHERE kind = 'failed')
FROM events
GROUP BY 1, 2
ORDER BY 1, 2

-- name: job_find_by_key
-- Jobs with this idempotency key under any name: one probe of the (name, key) index per
-- distinct name, the names found by skipping through that index (a loose index scan).
WITH RECURSIVE names AS (
    (SELECT name FROM {schema}.errands_jobs WHERE idempotency_key IS NOT NULL
     ORDER BY name LIMIT 1)
    UNION ALL
    SELECT (SELECT j.name FROM {schema}.errands_jobs AS j
            WHERE j.idempotency_key IS NOT NULL AND j.name > names.name
            ORDER BY j.name LIMIT 1)
    FROM names WHERE names.name IS NOT NULL
)
SELECT {job_columns}
FROM names JOIN {schema}.errands_jobs AS j
  ON j.name = names.name AND j.idempotency_key = %(key)s::text
ORDER BY j.id DESC
LIMIT %(limit)s

-- name: queue_settings_get
SELECT name, paused, max_running, rate_limit, rate_period, has_keys,
       extract(epoch FROM updated_at)::float8, updated_by, fair, aging
FROM {schema}.errands_queues WHERE name = %(name)s

-- name: queue_settings_list
SELECT name, paused, max_running, rate_limit, rate_period, has_keys,
       extract(epoch FROM updated_at)::float8, updated_by, fair, aging
FROM {schema}.errands_queues ORDER BY name

-- name: queue_declare
INSERT INTO {schema}.errands_queues AS s
    (name, max_running, rate_limit, rate_period, has_keys, updated_by, fair, aging)
VALUES (%(name)s, %(max_running)s, %(rate_limit)s, %(rate_period)s, %(has_keys)s, %(actor)s,
        %(fair)s, %(aging)s)
ON CONFLICT (name) DO UPDATE
SET max_running = excluded.max_running, rate_limit = excluded.rate_limit,
    rate_period = excluded.rate_period, has_keys = s.has_keys OR excluded.has_keys,
    updated_at = now(), updated_by = excluded.updated_by,
    fair = excluded.fair, aging = excluded.aging
WHERE s.max_running IS DISTINCT FROM excluded.max_running
   OR s.rate_limit IS DISTINCT FROM excluded.rate_limit
   OR s.rate_period IS DISTINCT FROM excluded.rate_period
   OR (excluded.has_keys AND NOT s.has_keys)
   OR s.fair IS DISTINCT FROM excluded.fair OR s.aging IS DISTINCT FROM excluded.aging

-- name: queue_declare_keyed
-- A queue this worker's code has limited job types in but does not declare: has_keys on,
-- nothing else written (the settings are whoever declared them).
INSERT INTO {schema}.errands_queues AS s (name, has_keys, updated_by)
VALUES (%(name)s, true, %(actor)s)
ON CONFLICT (name) DO UPDATE
SET has_keys = true, updated_at = now(), updated_by = excluded.updated_by
WHERE NOT s.has_keys

-- name: queue_set_paused
INSERT INTO {schema}.errands_queues (name, paused, updated_by)
VALUES (%(name)s, %(paused)s, %(actor)s)
ON CONFLICT (name) DO UPDATE
SET paused = excluded.paused, updated_at = now(), updated_by = excluded.updated_by

-- name: job_limit_declare
INSERT INTO {schema}.errands_job_limits (name, queue, rate_limit, rate_period)
VALUES (%(name)s, %(queue)s, %(rate_limit)s, %(rate_period)s)
ON CONFLICT (name) DO UPDATE
SET queue = excluded.queue, rate_limit = excluded.rate_limit,
    rate_period = excluded.rate_period, updated_at = now()

-- name: limited_claim_start
-- A limited claim's first statement on PostgreSQL: three in one round trip (its
-- transaction, begun by own_begin, carries the idle limit). The queue's
-- claim lock (an advisory lock: one limited claimer per queue, to the transaction's end),
-- its settings (queue_settings_get's columns; NULLs when the queue has no row) and the
-- rate-limited job types with due rows, each with its rate (a row's own: rows of one type
-- agree but while a deploy changes the rate; a loose index scan over errands_jobs_limited,
-- one probe per distinct name), as a JSON array. When the lock waits for another claimer,
-- this statement's snapshot is from before that claimer's commit: the settings and this
-- first reading of the rates may be from just before it (the rates are counted again
-- under their own locks before anything is claimed); every later statement of the claim
-- reads after it.
WITH RECURSIVE names AS (
    (SELECT name FROM {schema}.errands_jobs
     WHERE queue = %(queue)s AND state IN ('available', 'scheduled', 'retryable')
       AND (concurrency_key IS NOT NULL OR rate_limit IS NOT NULL) AND rate_limit IS NOT NULL
     ORDER BY name LIMIT 1)
    UNION ALL
    SELECT (SELECT j.name FROM {schema}.errands_jobs AS j
            WHERE j.queue = %(queue)s AND j.state IN ('available', 'scheduled', 'retryable')
              AND (j.concurrency_key IS NOT NULL OR j.rate_limit IS NOT NULL)
              AND j.rate_limit IS NOT NULL AND j.name > names.name
            ORDER BY j.name LIMIT 1)
    FROM names WHERE names.name IS NOT NULL
)
SELECT s.name, s.paused, s.max_running, s.rate_limit, s.rate_period, s.has_keys,
       extract(epoch FROM s.updated_at)::float8, s.updated_by, s.fair, s.aging,
       (SELECT json_agg(json_build_array(n.name, r.rate_limit, r.rate_period))
        FROM names AS n
        CROSS JOIN LATERAL (
            SELECT rate_limit, rate_period FROM {schema}.errands_jobs
            WHERE queue = %(queue)s AND name = n.name AND state IN ('available', 'scheduled', 'retryable')
              AND (concurrency_key IS NOT NULL OR rate_limit IS NOT NULL) AND rate_limit IS NOT NULL
            LIMIT 1
        ) AS r
        WHERE n.name IS NOT NULL)::text
FROM (SELECT pg_advisory_xact_lock(hashtext(%(lock)s))) AS l
LEFT JOIN {schema}.errands_queues AS s ON s.name = %(queue)s

-- name: own_begin
-- The BEGIN of errands' own transactions of several statements, with their idle limit in
-- the same round trip (two statements in one simple query, so without parameters: errands
-- writes the limit, in ms, in place of $IDLE). A transaction left idle longer than that
-- (its client went silent: a network cut, a frozen process) is ended by the server, which
-- releases its locks (a queue's claim lock, a workflow's row, the rows it wrote) instead of
-- holding every other worker up until the client comes back. Local to the transaction (a
-- pooler's other clients never see it).
-- READ COMMITTED whatever the database's or role's default_transaction_isolation: the
-- limited claim counts a key's running jobs again once it holds the key's lock, and sees
-- a claim committed meanwhile only with a snapshot per statement (under REPEATABLE READ
-- two claims of queues sharing a key of limit 1 both took it: 2 running); the fenced
-- writes update rows that heartbeats update too (a serialization failure under it).
-- And without JIT compilation: a statement whose estimated cost passes jit_above_cost
-- (an estimate that grows with the table, or a recursive CTE's guess) was compiled for
-- hundreds of ms to run in one: a fair claim's read of 50 keys took 0.67 s, 451 ms of it
-- JIT, under the queue's claim lock. Local to the transaction, like the idle limit.
BEGIN ISOLATION LEVEL READ COMMITTED; SELECT set_config('idle_in_transaction_session_timeout', '$IDLE', true),
                                      set_config('jit', 'off', true)

-- name: lock_bound
-- Sent after own_begin, in the same simple query, when the caller's deadline bounds its
-- waits for locks (errands.backends.base.calls_until: the maintenance leader's duties,
-- elections and resignation, a stopping worker's releases and deregistration): how long
-- each of the transaction's statements may wait for a lock another session holds (a row
-- a user's open transaction updated or selected FOR UPDATE, LOCK TABLE), errands writing
-- the time left, in ms, in place of $LOCK. Past it the statement fails (55P03): the
-- caller hears of it by its deadline, rather than wait for as long as the lock is held.
-- A shorter lock_timeout of the session's own (the role's, the URL's) stays. Local to
-- the transaction, like the idle limit.
SELECT set_config('lock_timeout',
                  CASE WHEN current_setting('lock_timeout')::interval > interval '0'
                        AND current_setting('lock_timeout')::interval <= $LOCK * interval '1 ms'
                       THEN current_setting('lock_timeout') ELSE '$LOCK' END,
                  true)

-- name: tx_guard
-- The idle limit of own_begin, set inside a transaction already open: a handler's
-- ctx.transaction() once errands writes the attempt's outcome in it (until then the
-- handler may think between statements; from then on only errands' statements follow).
-- And JIT off from there, as own_begin: errands' outcome and fan-in statements follow.
SELECT set_config('idle_in_transaction_session_timeout', %(idle)s, true),
       set_config('jit', 'off', true)

-- name: limited_claim_begin
-- The BEGIN of a limited claim: own_begin's, and generic plans for its first statement
-- and a fair queue's first reads, which follow it in the same message (see _LimitedStore
-- in backend.py); local to the transaction, reset by plans_by_default after them.
-- READ COMMITTED and without JIT, as own_begin (the recount after the key locks needs it).
BEGIN ISOLATION LEVEL READ COMMITTED; SELECT set_config('idle_in_transaction_session_timeout', '$IDLE', true),
                                      set_config('jit', 'off', true),
                                      set_config('plan_cache_mode', 'force_generic_plan', true)

-- name: plans_by_default
-- After a limited claim's first reads: the server chooses its plans as it would.
SET LOCAL plan_cache_mode TO DEFAULT

-- name: plans_with_values
-- Before a limited claim's write: planned with its ids. A generic plan made while the
-- table was empty (a worker started before its jobs came) read the ids through the due
-- rows' index, every due row, and kept doing so once there were 100,000 of them (16 ms
-- a claim instead of 4).
SET LOCAL plan_cache_mode = force_custom_plan

-- name: queues_with_limits
-- Which of a worker's queues must be claimed through claim_limited: a queue with a
-- cluster-wide limit or rate, or with due rows that carry a limit of their own (a
-- concurrency key or a job type's rate), whatever queue they were enqueued into.
SELECT q.name FROM unnest(%(queues)s::text[]) AS q(name)
WHERE EXISTS (SELECT 1 FROM {schema}.errands_queues AS s
              WHERE s.name = q.name AND (s.max_running IS NOT NULL OR s.rate_limit IS NOT NULL
                                         OR s.fair OR s.aging IS NOT NULL))
   OR EXISTS (SELECT 1 FROM {schema}.errands_jobs AS j
              WHERE j.queue = q.name AND j.state IN ('available', 'scheduled', 'retryable')
                AND (j.concurrency_key IS NOT NULL OR j.rate_limit IS NOT NULL))

-- name: limit_locks
-- The concurrency keys and rate buckets a limited claim is about to take, locked for its
-- transaction in one order so that claims of different queues sharing a key never both
-- count it free; one order means no deadlock. The order is the locks' own (their 32-bit
-- hashes), not the names': two names whose hashes collide (likely among ~100,000 keys)
-- made two claims lock one lock id in crossed orders, and PostgreSQL aborted one.
SELECT pg_advisory_xact_lock(l.id)
FROM (SELECT DISTINCT hashtext(%(prefix)s || name) AS id
      FROM unnest(%(names)s::text[]) AS name) AS l
ORDER BY l.id

-- name: dead_hooks_forget
-- Records of on_dead hooks whose job is no longer dead (replayed, discarded, deleted):
-- nothing to run for them.
DELETE FROM {schema}.errands_dead_hooks AS h
WHERE h.died_at < now() - make_interval(secs => %(older_than)s)
  AND NOT EXISTS (SELECT 1 FROM {schema}.errands_jobs AS j
                  WHERE j.id = h.job_id AND j.state = 'dead')

-- name: dead_hooks_due
-- Dead jobs whose on_dead hooks are due longer than older_than seconds, oldest first.
SELECT job_id FROM {schema}.errands_dead_hooks
WHERE died_at < now() - make_interval(secs => %(older_than)s)
ORDER BY died_at
LIMIT %(limit)s

-- name: dead_hooks_done
-- The hooks of the job's death at died_at ran (a later death keeps its record; the
-- millisecond covers the float the caller read the time as).
DELETE FROM {schema}.errands_dead_hooks
WHERE job_id = %(job_id)s AND died_at <= to_timestamp(%(died_at)s) + interval '1 millisecond'

-- name: queue_running_count
SELECT count(*) FROM {schema}.errands_jobs WHERE state = 'running' AND queue = %(queue)s

-- name: rate_count
-- Starts inside the window, and when the oldest of them leaves it (seconds from now).
-- The clock is read now (clock_timestamp), not at the transaction's start: a claim that
-- waited 3 s for the queue's claim lock counted a window 3 s old, and logged its starts
-- 3 s in the past, so the next claim's window left them out (a '20/s' rate took 40).
SELECT count(*),
       extract(epoch FROM min(at) + make_interval(secs => %(period)s) - clock_timestamp())::float8
FROM {schema}.errands_rate_log
WHERE bucket = %(bucket)s AND at > clock_timestamp() - make_interval(secs => %(period)s)

-- name: rate_log_insert
-- Each start is kept with its bucket's period: pruning keeps a bucket's rows for exactly
-- the window its count reads (a '1000/s' bucket holds about a second of rows, not a day);
-- and with its claim's lease token, so an undone claim takes its starts back with it
-- (job_claim_undo).
INSERT INTO {schema}.errands_rate_log (bucket, period, at, token)
SELECT %(bucket)s, %(period)s, clock_timestamp(), %(token)s FROM generate_series(1, %(n)s)

-- name: rate_log_unstart
-- Prefetched jobs just given back (job_release_many with prefetched: claimed, never
-- begun): the starts their claim logged for them against rates go back too, as an undone
-- claim's do (job_claim_undo); a rate-limited queue counted each such job twice (the
-- claim given back at a stop, then its run). A claim logs one row per job it starts in
-- each bucket the job counts in (its queue's 'queue:<queue>', its type's 'job:<name>'),
-- all with its lease token, which the claim's jobs that began share (they keep theirs):
-- k rows of that token and bucket go for the k jobs given back, any k of them (one
-- claim's rows of one bucket are alike). Through the (bucket, at) index, a bucket at a
-- time; a row pruned meanwhile is simply not there.
DELETE FROM {schema}.errands_rate_log AS r
WHERE r.ctid = ANY(ARRAY(
    SELECT l.ctid
    FROM (SELECT g.token, b.bucket, count(*) AS k
          FROM unnest(%(ids)s::bigint[], %(tokens)s::text[]) AS g(id, token)
          JOIN {schema}.errands_jobs AS j ON j.id = g.id
          CROSS JOIN LATERAL (VALUES ('queue:' || j.queue), ('job:' || j.name)) AS b(bucket)
          GROUP BY g.token, b.bucket) AS w
    CROSS JOIN LATERAL (
        SELECT l.ctid FROM {schema}.errands_rate_log AS l
        WHERE l.bucket = w.bucket AND l.token = w.token
        LIMIT w.k
    ) AS l
))

-- name: rate_log_prune
DELETE FROM {schema}.errands_rate_log
WHERE at < now() - make_interval(secs => LEAST(period, %(older_than)s))

-- name: fair_usage_prune
-- The usage of keys that ended no attempt for older_than seconds (the retention) and have
-- none running or pending: their decayed worker time is nothing by then (a 60 s half-life)
-- and their totals go with their finished jobs. The two probes match the partial indexes
-- errands_jobs_fair_running and errands_jobs_fair. At most limit rows a call.
DELETE FROM {schema}.errands_fair_usage
WHERE at < now() - make_interval(secs => %(older_than)s)  -- again: a fold may land first
  AND (queue, key) IN (
    SELECT u.queue, u.key FROM {schema}.errands_fair_usage AS u
    WHERE u.at < now() - make_interval(secs => %(older_than)s)
      AND NOT EXISTS (SELECT 1 FROM {schema}.errands_jobs AS j
                      WHERE j.queue = u.queue AND j.fair_key = u.key AND j.state = 'running')
      AND NOT EXISTS (SELECT 1 FROM {schema}.errands_jobs AS j
                      WHERE j.queue = u.queue AND j.fair_key = u.key
                        AND j.state IN ('available', 'scheduled', 'retryable'))
    LIMIT %(limit)s)

-- name: claim_candidates
-- Due rows of one limited queue in claim order; $RESCUED makes the fresh and the suspect
-- variants. Jobs whose key already runs at its limit, and job types out of rate-limit
-- room (blocked), are left out here, so they never fill the lookahead and hold claimable
-- jobs behind them; so are, when the claim reads again, the keys it filled (full) and the
-- rows it chose (taken). claim_limited checks the rest under the key and rate locks.
SELECT id, name, concurrency_key, concurrency_limit, rate_limit, rate_period
FROM {schema}.errands_jobs AS j
WHERE state IN ('available', 'scheduled', 'retryable')
  AND queue = %(queue)s
  AND $RESCUED
  AND run_at <= now()
  AND NOT (name = ANY(%(blocked)s::text[]))
  AND NOT (id = ANY(%(taken)s::bigint[]))
  AND (concurrency_key IS NULL OR NOT (concurrency_key = ANY(%(full)s::text[])))
  AND (%(names)s::text[] IS NULL OR array_position(%(names)s::text[], name) IS NOT NULL)
  AND (concurrency_key IS NULL
       OR (SELECT count(*) FROM {schema}.errands_jobs AS r
           WHERE r.state = 'running' AND r.concurrency_key = j.concurrency_key)
          < COALESCE(concurrency_limit, 1))
ORDER BY priority DESC, run_at, id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: running_per_key
SELECT concurrency_key, count(*) FROM {schema}.errands_jobs
WHERE state = 'running' AND concurrency_key = ANY(%(keys)s::text[])
GROUP BY concurrency_key

-- name: job_claim_ids
-- The rows a limited claim chose, as it read them: its reads lock no row, so an edit
-- committed since (rescheduled, moved to another queue, keyed anew) leaves the row out,
-- not claimed early, in the wrong queue or past another key's cap. Times are taken when
-- the write runs (clock_timestamp): now() is the transaction's start, before the wait
-- for the queue's claim lock, and a lease counted from it was that much shorter.
UPDATE {schema}.errands_jobs AS j
SET state = 'running',
    attempt = j.attempt + 1,
    lease_owner = %(worker_id)s,
    lease_token = %(token)s,
    lease_expires_at = clock_timestamp()
                       + make_interval(secs => COALESCE(j.lease_seconds, %(lease_default)s)),
    attempted_at = clock_timestamp(),
    progress = NULL, progress_message = NULL
WHERE j.id = ANY(%(ids)s::bigint[])
  -- checked on the rows the ids find, never through an index of their own: written
  -- plainly, the planner read every due row of the queue through errands_jobs_due (with
  -- statistics taken on an empty table, which say that index holds no row, even when
  -- planned with the ids). The state written so implies no partial index's predicate.
  AND j.state || '' IN ('available', 'scheduled', 'retryable')
  AND j.queue || '' = %(queue)s AND j.run_at + interval '0' <= now()
  AND (j.concurrency_key IS NULL OR j.concurrency_key = ANY(%(keys)s::text[]))
RETURNING {job_columns}

-- name: cron_states
SELECT name, extract(epoch FROM last_slot)::float8, last_job_id,
       extract(epoch FROM next_slot)::float8, expression, timezone
FROM {schema}.errands_cron ORDER BY name

-- name: cron_save
INSERT INTO {schema}.errands_cron AS c
    (name, expression, timezone, last_slot, last_job_id, next_slot)
VALUES (%(name)s, %(expression)s, %(timezone)s, to_timestamp(%(last_slot)s), %(last_job_id)s,
        to_timestamp(%(next_slot)s))
ON CONFLICT (name) DO UPDATE
SET expression = excluded.expression, timezone = excluded.timezone,
    last_slot = CASE WHEN %(rewind)s THEN excluded.last_slot
                     ELSE GREATEST(c.last_slot, excluded.last_slot) END,
    last_job_id = COALESCE(excluded.last_job_id, c.last_job_id),
    next_slot = excluded.next_slot, updated_at = now()

-- name: job_count_by_queue
-- Jobs in one state per queue: for any state but available, running and completed (the
-- DLQ's dead), from errands_jobs_listed_queue alone.
SELECT queue, count(*) FROM {schema}.errands_jobs WHERE state = %(state)s GROUP BY queue

-- name: job_names
-- The distinct job names of the newest 100,000 jobs (the unfinished ones are among them
-- unless a backlog is larger), for suggestions when a filter matched nothing. No index
-- leads with the name (version 12 dropped errands_jobs_name: every job paid two entries
-- in it), so the read is bounded instead: at most 100,000 rows, newest first by id.
SELECT DISTINCT name
FROM (SELECT name FROM {schema}.errands_jobs ORDER BY id DESC LIMIT 100000) AS recent
ORDER BY name
LIMIT %(limit)s

-- name: queue_forget
-- Only while no job waits in the queue (pending, or waiting for its workflow's parents
-- or a signal) or runs (the App's check, again in the delete: a job enqueued between
-- that check and this delete would run in a queue resumed).
DELETE FROM {schema}.errands_queues AS q WHERE q.name = %(name)s
  AND NOT EXISTS (SELECT 1 FROM {schema}.errands_jobs AS j
                  WHERE j.queue = %(name)s
                    AND j.state IN ('scheduled', 'available', 'running', 'retryable',
                                    'waiting'))

-- name: job_suspend
-- ctx.wait_for_signal: the attempt ends without charging it (attempt - 1), lease and slot
-- given back; an operator's cancel while it ran ends it cancelled instead. It locks the
-- row; job_resume_if_signalled follows in the same transaction, so its fresh snapshot
-- sees any signal committed before the lock (app.signal locks the row first, too).
WITH ended AS (
UPDATE {schema}.errands_jobs
SET state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'waiting' END,
    wait_signal = CASE WHEN cancel_requested THEN NULL ELSE %(signal)s::text END,
    wait_until = CASE WHEN cancel_requested OR %(timeout)s::float8 IS NULL THEN NULL
                      ELSE now() + make_interval(secs => %(timeout)s::float8) END,
    attempt = attempt - 1,
    run_at = now(),
    finished_at = CASE WHEN cancel_requested THEN now() END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
WHERE id = %(id)s AND lease_token = %(token)s AND state = 'running'
RETURNING id, state, workflow_id
), {notify_ended}
SELECT id, state, workflow_id FROM ended CROSS JOIN notified

-- name: job_resume_if_signalled
-- A waiting job whose signal is stored becomes available (after a suspension, and after
-- app.signal stored one).
UPDATE {schema}.errands_jobs AS j
SET state = 'available', run_at = now(), wait_signal = NULL, wait_until = NULL
WHERE j.id = %(id)s AND j.state = 'waiting'
  AND EXISTS (SELECT 1 FROM {schema}.errands_signals AS s
              WHERE s.job_id = j.id AND s.name = j.wait_signal)

-- name: signal_insert
INSERT INTO {schema}.errands_signals (job_id, name, payload, sent_by)
VALUES (%(job_id)s, %(name)s, %(payload)s::jsonb, %(actor)s)

-- name: signal_get
SELECT payload::text FROM {schema}.errands_signals
WHERE job_id = %(job_id)s AND name = %(name)s ORDER BY id LIMIT 1

-- name: job_list_expired_waits
SELECT id, name, queue, attempt, max_attempts, wait_signal FROM {schema}.errands_jobs
WHERE state = 'waiting' AND wait_until <= now()
ORDER BY wait_until
LIMIT %(limit)s

-- name: job_expire_wait
-- A wait past its timeout is a failed attempt (charged now: the suspension was not).
UPDATE {schema}.errands_jobs
SET state = %(state)s,
    attempt = attempt + 1,
    errors = errors || jsonb_build_array(
             %(error)s::jsonb || jsonb_build_object('at', extract(epoch FROM now()))),
    run_at = now() + make_interval(secs => %(delay)s),
    finished_at = CASE WHEN %(state)s = 'dead' THEN now() END,
    wait_signal = NULL, wait_until = NULL
WHERE id = %(id)s AND state = 'waiting' AND wait_signal = %(signal)s AND wait_until <= now()
  AND attempt = %(attempt)s

-- name: job_edit
-- An operator's edit of a pending job, guarded by its state: a running or finished job is
-- never changed (the claim and this write serialise on the row: the claim skips a row
-- this edit has locked, and this edit re-checks the state after a claim's). A new run_at
-- makes the job scheduled or available by it (a retryable job stays retryable). The keys
-- are written when the App derived them anew (%(keys)s: new arguments, or another queue),
-- the concurrency key with its limit, and the job type's rate, from the same App's code,
-- as an enqueue stores them.
UPDATE {schema}.errands_jobs AS j
SET run_at = CASE WHEN %(set_run_at)s
                  THEN COALESCE(to_timestamp(%(run_at)s::float8),
                                now() + make_interval(secs => %(delay)s::float8))
                  ELSE j.run_at END,
    state = CASE WHEN %(set_run_at)s AND j.state <> 'retryable'
                 THEN CASE WHEN COALESCE(to_timestamp(%(run_at)s::float8),
                                         now() + make_interval(secs => %(delay)s::float8))
                                > now() THEN 'scheduled' ELSE 'available' END
                 ELSE j.state END,
    priority = COALESCE(%(priority)s::int, j.priority),
    queue = COALESCE(%(queue)s::text, j.queue),
    args = COALESCE(%(args)s::jsonb, j.args),
    concurrency_key = CASE WHEN %(keys)s THEN %(concurrency_key)s::text
                           ELSE j.concurrency_key END,
    concurrency_limit = CASE WHEN %(keys)s THEN %(concurrency_limit)s::int
                             ELSE j.concurrency_limit END,
    rate_limit = CASE WHEN %(keys)s THEN %(rate_limit)s::int ELSE j.rate_limit END,
    rate_period = CASE WHEN %(keys)s THEN %(rate_period)s::float8 ELSE j.rate_period END,
    fair_key = CASE WHEN %(keys)s THEN %(fair_key)s::text ELSE j.fair_key END
WHERE j.id = %(id)s AND j.state IN ('scheduled', 'available', 'retryable')

-- name: fair_fold_cte
-- Not run alone: the fair_fold marker of the statements that end attempts (finish,
-- release, rescue, and fair_fold). It folds the attempts of CTE "ended" (f_queue, f_key,
-- f_started, f_ran, f_due) into their keys' usage, decayed by the half-life, with their
-- dwell (due -> start), one row per key (ordered, so concurrent folds never deadlock).
-- An attempt counts the seconds its handler ran (f_ran, the worker's clock) when the
-- write carries them, else the seconds from its claim to this write.
fold AS (
    INSERT INTO {schema}.errands_fair_usage AS u
        (queue, key, usage, recent, at, last_started, seconds_total, dwell_total, attempts)
    SELECT e.f_queue, e.f_key, sum(e.seconds), count(*), now(), max(e.f_started),
           sum(e.seconds), sum(greatest(extract(epoch FROM e.f_started - e.f_due), 0)),
           count(*)
    FROM (SELECT f_queue, f_key, f_started, f_due,
                 greatest(COALESCE(f_ran, extract(epoch FROM now() - f_started)), 0) AS seconds
          FROM ended) AS e
    WHERE e.f_key IS NOT NULL
    GROUP BY e.f_queue, e.f_key
    ORDER BY e.f_queue, e.f_key
    ON CONFLICT (queue, key) DO UPDATE
    SET usage = u.usage * power(0.5, greatest(extract(epoch FROM excluded.at - u.at), 0)
                                     / %(half_life)s::float8) + excluded.usage,
        recent = u.recent * power(0.5, greatest(extract(epoch FROM excluded.at - u.at), 0)
                                       / %(half_life)s::float8) + excluded.recent,
        at = excluded.at,
        last_started = greatest(u.last_started, excluded.last_started),
        seconds_total = u.seconds_total + excluded.seconds_total,
        dwell_total = u.dwell_total + excluded.dwell_total,
        attempts = u.attempts + excluded.attempts
)

-- name: dead_locked_cte
-- Not run alone: the dead_locked marker of job_replay and job_discard. The jobs of
-- %(ids)s still dead, locked in id order (two bulk actions wait for each other, never in
-- a cycle), as CTE "dead".
WITH dead AS (
    SELECT id FROM {schema}.errands_jobs
    WHERE id = ANY(%(ids)s::bigint[]) AND state = 'dead'
    ORDER BY id
    FOR UPDATE
)

-- name: notify_ended_cte
-- Not run alone: the notify_ended marker of the statements that end attempts (finish,
-- release, rescue, suspend). One NOTIFY on the results channel (results.py), sent at
-- commit, with the ids of the rows of CTE "ended" (id, state) that ended, or '*' when
-- they are too many for a payload; none when no row ended. The statement's final SELECT
-- reads "notified": a CTE that nothing reads is not run. Every other end of a job (from
-- a state other than running) is announced by the errands_jobs_ended trigger (schema 17).
-- It must stay one row whatever ended (an aggregate without GROUP BY): the final SELECT
-- cross-joins it, and with no row there the statement would return none, which the
-- callers read as stale outcomes.
notified AS MATERIALIZED (
    SELECT count(pg_notify({done_channel},
                           CASE WHEN length(d.ids) > 7000 THEN '*' ELSE d.ids END)) AS n
    FROM (SELECT string_agg(e.id::text, ',' ORDER BY e.id) AS ids FROM ended AS e
          WHERE e.state IN ('completed', 'dead', 'cancelled', 'discarded')) AS d
    WHERE d.ids IS NOT NULL
)

-- name: fair_due
-- Not run alone: the fair_due marker of the statements that end attempts. A fair row's
-- due time before the statement's own update (a subquery reads the statement's snapshot,
-- which its update does not change); nothing is read for a row without a fair key.
CASE WHEN j.fair_key IS NOT NULL
     THEN (SELECT p.run_at FROM {schema}.errands_jobs AS p WHERE p.id = j.id) END AS f_due

-- name: fair_fold
-- A suspension's fold (ctx.wait_for_signal): the attempt's row locked under its fence,
-- its usage folded; job_suspend follows in the same transaction.
WITH ended AS (
    SELECT queue AS f_queue, fair_key AS f_key, attempted_at AS f_started,
           %(ran)s::float8 AS f_ran, run_at AS f_due
    FROM {schema}.errands_jobs
    WHERE id = %(id)s AND lease_token = %(token)s AND state = 'running'
      AND (%(expired)s = 0 OR lease_expires_at < now())
    FOR UPDATE
), {fair_fold}
SELECT count(*) FROM ended

-- name: fair_heads
-- A fair queue's due rows, per (key, priority level), for at most %(limit)s keys in key
-- order: those after %(after)s (from the first key when NULL) and, when %(before)s is not
-- NULL, up to it (the rotation's wrap). Each key's levels are found by skipping through
-- errands_jobs_fair (one probe per key and level); each level gives its first per_key rows
-- in (run_at, id) order. A key read whose rows are none due now comes once with NULLs (the
-- rotation moves past it). Rows of a busy concurrency key, or of a job type out of rate
-- room (blocked), are left out. Rescued rows (suspects) come with the fresh ones when
-- suspects, marked: see _pick_fair. Each row also carries its key's standing (the columns
-- of fair_states), so a claim reads its window's keys in one statement.
WITH RECURSIVE levels AS (
    SELECT * FROM (
        (SELECT fair_key AS key, priority, 1 AS n FROM {schema}.errands_jobs
         WHERE %(after)s::text IS NULL
           AND queue = %(queue)s AND state IN ('available', 'scheduled', 'retryable')
           AND fair_key IS NOT NULL
         ORDER BY fair_key, priority LIMIT 1)
        UNION ALL
        (SELECT fair_key AS key, priority, 1 AS n FROM {schema}.errands_jobs
         WHERE queue = %(queue)s AND state IN ('available', 'scheduled', 'retryable')
           AND fair_key > %(after)s::text
         ORDER BY fair_key, priority LIMIT 1)
        LIMIT 1) AS first
    WHERE %(before)s::text IS NULL OR first.key <= %(before)s::text
    UNION ALL
    SELECT n.key, n.priority, l.n + n.step
    FROM levels AS l
    CROSS JOIN LATERAL (
        -- the key's next level, else the next key's first: one index seek (a row
        -- comparison on the index's columns; two seeks before, the first of which found
        -- nothing for a key of one level: 38 % of the buffers read over 86 keys)
        SELECT fair_key AS key, priority, CASE WHEN fair_key = l.key THEN 0 ELSE 1 END AS step
        FROM {schema}.errands_jobs
        WHERE queue = %(queue)s AND state IN ('available', 'scheduled', 'retryable')
          AND fair_key IS NOT NULL AND (fair_key, priority) > (l.key, l.priority)
        ORDER BY fair_key, priority LIMIT 1) AS n
    WHERE (n.step = 0 OR l.n < %(limit)s)
      AND (%(before)s::text IS NULL OR n.key <= %(before)s::text)
), running AS MATERIALIZED (
    -- the window's running rows, read once, grouped by key into one object that each key
    -- looks itself up in (a per-key aggregate, or a join the planner could not size, let
    -- a planner with statistics from before the rows existed read them once per key)
    SELECT jsonb_object_agg(g.key, jsonb_build_array(g.seconds, g.latest, g.n)) AS by_key
    FROM (SELECT fair_key AS key,
                 sum(greatest(extract(epoch FROM now() - attempted_at), 0))::float8 AS seconds,
                 extract(epoch FROM max(attempted_at))::float8 AS latest, count(*) AS n
          FROM {schema}.errands_jobs
          WHERE queue = %(queue)s AND state = 'running'
            AND fair_key = ANY(ARRAY(SELECT key FROM levels))
          GROUP BY fair_key) AS g
)
SELECT c.id, c.name, c.concurrency_key, c.concurrency_limit, c.rate_limit, c.rate_period,
       l.key, c.priority, extract(epoch FROM c.run_at)::float8, c.rescues > 0,
       -- the key's standing, as fair_states gives it
       u.usage, u.recent, extract(epoch FROM u.at)::float8,
       extract(epoch FROM u.last_started)::float8, (r.by_key -> l.key ->> 0)::float8,
       (r.by_key -> l.key ->> 1)::float8, w.weight, extract(epoch FROM now())::float8,
       COALESCE((r.by_key -> l.key ->> 2)::bigint, 0)
FROM levels AS l
CROSS JOIN running AS r
-- one primary-key probe per key (LIMIT 1 keeps each a probe: joined, a planner that
-- thought the usage table empty read all of it once per key)
LEFT JOIN LATERAL (
    SELECT usage, recent, at, last_started FROM {schema}.errands_fair_usage
    WHERE queue = %(queue)s AND key = l.key LIMIT 1) AS u ON true
LEFT JOIN LATERAL (
    SELECT weight FROM {schema}.errands_fair_weights WHERE key = l.key LIMIT 1) AS w ON true
LEFT JOIN LATERAL (
    SELECT j.* FROM {schema}.errands_jobs AS j
    WHERE j.queue = %(queue)s AND j.state IN ('available', 'scheduled', 'retryable')
      AND j.fair_key = l.key AND j.priority = l.priority
      AND j.run_at <= now() AND (%(suspects)s OR j.rescues = 0)
      AND NOT (j.name = ANY(%(blocked)s::text[]))
      AND (%(names)s::text[] IS NULL OR array_position(%(names)s::text[], j.name) IS NOT NULL)
      AND (j.concurrency_key IS NULL
           OR (SELECT count(*) FROM {schema}.errands_jobs AS r
               WHERE r.state = 'running' AND r.concurrency_key = j.concurrency_key)
              < COALESCE(j.concurrency_limit, 1))
    ORDER BY j.run_at, j.id
    LIMIT %(per_key)s) AS c ON true
ORDER BY l.n, l.priority, c.run_at, c.id

-- name: fair_more
-- The first per_key due rows of each level of the keys of keys (a claim with more room
-- than keys reads more of each): the same rows as fair_heads, for those keys only.
WITH RECURSIVE levels AS (
    SELECT k.key, (SELECT priority FROM {schema}.errands_jobs
                   WHERE queue = %(queue)s AND state IN ('available', 'scheduled', 'retryable')
                     AND fair_key = k.key
                   ORDER BY priority LIMIT 1) AS priority
    FROM unnest(%(keys)s::text[]) AS k(key)
    UNION ALL
    SELECT l.key, (SELECT priority FROM {schema}.errands_jobs
                   WHERE queue = %(queue)s AND state IN ('available', 'scheduled', 'retryable')
                     AND fair_key = l.key AND priority > l.priority
                   ORDER BY priority LIMIT 1)
    FROM levels AS l
    WHERE l.priority IS NOT NULL
)
SELECT c.id, c.name, c.concurrency_key, c.concurrency_limit, c.rate_limit, c.rate_period,
       c.fair_key, c.priority, extract(epoch FROM c.run_at)::float8, c.rescues > 0
FROM levels AS l
CROSS JOIN LATERAL (
    SELECT j.* FROM {schema}.errands_jobs AS j
    WHERE j.queue = %(queue)s AND j.state IN ('available', 'scheduled', 'retryable')
      AND j.fair_key = l.key AND j.priority = l.priority
      AND j.run_at <= now() AND (%(suspects)s OR j.rescues = 0)
      AND NOT (j.name = ANY(%(blocked)s::text[]))
      AND (%(names)s::text[] IS NULL OR array_position(%(names)s::text[], j.name) IS NOT NULL)
      AND (j.concurrency_key IS NULL
           OR (SELECT count(*) FROM {schema}.errands_jobs AS r
               WHERE r.state = 'running' AND r.concurrency_key = j.concurrency_key)
              < COALESCE(j.concurrency_limit, 1))
    ORDER BY j.run_at, j.id
    LIMIT %(per_key)s) AS c
WHERE l.priority IS NOT NULL

-- name: fair_lookahead
-- A fair queue's first due rows in claim order (priority, due time, id): the rows without a
-- fair key (enqueued by code that gave them none, which share one key: no index finds them
-- apart from the keyed ones, so the read stays bounded), and the keyed rows of a priority
-- above `above` (NULL: none), which a windowed claim needs (see _pick_fair).
SELECT id, name, concurrency_key, concurrency_limit, rate_limit, rate_period, fair_key,
       priority, extract(epoch FROM run_at)::float8, rescues > 0
FROM (SELECT * FROM {schema}.errands_jobs
      WHERE queue = %(queue)s AND state IN ('available', 'scheduled', 'retryable')
        AND run_at <= now() AND (%(suspects)s OR rescues = 0)
      ORDER BY priority DESC, run_at, id
      LIMIT %(lookahead)s) AS j
WHERE (fair_key IS NULL OR priority > %(above)s::int)
  AND (%(names)s::text[] IS NULL OR array_position(%(names)s::text[], name) IS NOT NULL)

-- name: fair_states
-- Per key of keys in a queue: its folded usage (usage, recent attempts, when folded, last
-- start), the seconds its running attempts have used so far, their latest start, its
-- weight, the database's now (all times epoch seconds), and how many attempts run.
-- The running rows of those keys are read once, grouped by key (errands_jobs_fair_running).
WITH running AS (
    SELECT fair_key AS key,
           sum(greatest(extract(epoch FROM now() - attempted_at), 0))::float8 AS seconds,
           extract(epoch FROM max(attempted_at))::float8 AS latest, count(*) AS n
    FROM {schema}.errands_jobs
    WHERE queue = %(queue)s AND state = 'running' AND fair_key = ANY(%(keys)s::text[])
    GROUP BY fair_key
)
SELECT k.key, u.usage, u.recent, extract(epoch FROM u.at)::float8,
       extract(epoch FROM u.last_started)::float8, r.seconds, r.latest, w.weight,
       extract(epoch FROM now())::float8, r.n
FROM unnest(%(keys)s::text[]) AS k(key)
LEFT JOIN LATERAL (  -- primary-key probes, whatever the statistics say (see fair_heads)
    SELECT usage, recent, at, last_started FROM {schema}.errands_fair_usage
    WHERE queue = %(queue)s AND key = k.key LIMIT 1) AS u ON true
LEFT JOIN LATERAL (
    SELECT weight FROM {schema}.errands_fair_weights WHERE key = k.key LIMIT 1) AS w ON true
LEFT JOIN running AS r ON r.key = k.key

-- name: fair_weight_set
INSERT INTO {schema}.errands_fair_weights AS w (key, weight, updated_by)
VALUES (%(key)s, %(weight)s, %(actor)s)
ON CONFLICT (key) DO UPDATE
SET weight = excluded.weight, updated_at = now(), updated_by = excluded.updated_by

-- name: fair_weight_delete
DELETE FROM {schema}.errands_fair_weights WHERE key = %(key)s

-- name: fair_weights_list
SELECT key, weight, extract(epoch FROM updated_at)::float8, updated_by
FROM {schema}.errands_fair_weights ORDER BY key

-- name: fair_usage_list
-- Per key of a queue: worker seconds (decayed, and in all), attempts, dwell in all, the
-- attempts running now, and the jobs due now.
WITH keys AS (
    SELECT key FROM {schema}.errands_fair_usage WHERE queue = %(queue)s
    UNION
    SELECT fair_key FROM {schema}.errands_jobs
    WHERE queue = %(queue)s AND state = 'running' AND fair_key IS NOT NULL
    UNION
    SELECT fair_key FROM {schema}.errands_jobs
    WHERE queue = %(queue)s AND state IN ('available', 'scheduled', 'retryable')
      AND fair_key IS NOT NULL
)
SELECT keys.key,
       COALESCE(u.usage * power(0.5, greatest(extract(epoch FROM now() - u.at), 0)
                                     / %(half_life)s), 0) + COALESCE(r.seconds, 0),
       COALESCE(u.seconds_total, 0), COALESCE(u.attempts, 0), COALESCE(u.dwell_total, 0),
       COALESCE(r.n, 0),
       (SELECT count(*) FROM {schema}.errands_jobs AS p
        WHERE p.queue = %(queue)s AND p.fair_key = keys.key
          AND p.state IN ('available', 'scheduled', 'retryable') AND p.run_at <= now()),
       COALESCE(w.weight, 1.0)
FROM keys
LEFT JOIN {schema}.errands_fair_usage AS u ON u.queue = %(queue)s AND u.key = keys.key
LEFT JOIN {schema}.errands_fair_weights AS w ON w.key = keys.key
LEFT JOIN LATERAL (
    SELECT sum(greatest(extract(epoch FROM now() - attempted_at), 0))::float8 AS seconds,
           count(*) AS n
    FROM {schema}.errands_jobs
    WHERE queue = %(queue)s AND fair_key = keys.key AND state = 'running') AS r ON true
ORDER BY keys.key

-- All SQL of the PostgreSQL backend, with the same query names as the SQLite backend.
-- Markers, filled once by the loader: {schema} (the quoted schema name) and {job_columns}
-- (the JobRow column list over alias j, times as epoch seconds). Parameters are psycopg's
-- %(name)s placeholders, always bound, never formatted. Batches travel as arrays through
-- unnest(), so one round trip carries a whole batch.

-- name: job_insert
-- One round trip: insert and, when this process has not notified the queue within its
-- window (channel not null), NOTIFY in the same statement; id is NULL when deduplicated.
WITH ins AS (
INSERT INTO {schema}.errands_jobs AS j
    (name, queue, args, meta, state, priority, max_attempts, run_at, idempotency_key,
     timeout, lease_seconds)
VALUES (%(name)s, %(queue)s, %(args)s::jsonb, %(meta)s::jsonb,
        CASE WHEN COALESCE(to_timestamp(%(run_at)s), now() + make_interval(secs => %(delay)s))
                  > now() THEN 'scheduled' ELSE 'available' END,
        %(priority)s, %(max_attempts)s,
        COALESCE(to_timestamp(%(run_at)s), now() + make_interval(secs => %(delay)s)),
        %(key)s, %(timeout)s, %(lease_seconds)s)
ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING j.id
), note AS (
    SELECT pg_notify(%(channel)s::text, %(queue)s)
    WHERE %(channel)s::text IS NOT NULL AND EXISTS (SELECT 1 FROM ins)
)
SELECT (SELECT id FROM ins), (SELECT count(*) FROM note)

-- name: job_insert_many
-- ids are allocated first (job_allocate_ids) so results map back to requests in order.
INSERT INTO {schema}.errands_jobs AS j
    (id, name, queue, args, meta, state, priority, max_attempts, run_at, idempotency_key,
     timeout, lease_seconds)
SELECT r.id, r.name, r.queue, r.args::jsonb, r.meta::jsonb,
       CASE WHEN COALESCE(to_timestamp(r.run_at), now() + make_interval(secs => r.delay))
                 > now() THEN 'scheduled' ELSE 'available' END,
       r.priority, r.max_attempts,
       COALESCE(to_timestamp(r.run_at), now() + make_interval(secs => r.delay)),
       r.key, r.timeout, r.lease_seconds
FROM unnest(%(ids)s::bigint[], %(names)s::text[], %(queues)s::text[], %(args)s::text[],
            %(metas)s::text[], %(priorities)s::int[], %(max_attempts)s::int[],
            %(run_ats)s::float8[], %(delays)s::float8[], %(keys)s::text[],
            %(timeouts)s::float8[], %(leases)s::float8[])
     AS r(id, name, queue, args, meta, priority, max_attempts, run_at, delay, key, timeout,
          lease_seconds)
ORDER BY r.id
ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING j.id

-- name: job_allocate_ids
SELECT nextval(pg_get_serial_sequence('{schema}.errands_jobs', 'id'))
FROM generate_series(1, %(n)s)

-- name: job_id_by_key
SELECT id FROM {schema}.errands_jobs WHERE name = %(name)s AND idempotency_key = %(key)s

-- name: job_claim
-- One statement for every queue: each queue's due rows in claim order, up to its cap,
-- locked with SKIP LOCKED so concurrent claimers never wait on each other's rows.
WITH picked AS (
    SELECT p.id
    FROM unnest(%(queues)s::text[], %(limits)s::int[]) AS q(name, cap)
    CROSS JOIN LATERAL (
        SELECT id FROM {schema}.errands_jobs
        WHERE state IN ('available', 'scheduled', 'retryable')
          AND queue = q.name
          AND run_at <= now()
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
    attempted_at = now()
FROM picked
WHERE j.id = picked.id
RETURNING {job_columns}

-- name: job_finish_many
-- A cancel requested while the job ran turns a failure (retry or dead) into 'cancelled':
-- it never runs again, and an operator's cancel is not reported as a dead job.
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
FROM unnest(%(ids)s::bigint[], %(tokens)s::text[], %(states)s::text[], %(results)s::text[],
            %(errors)s::text[], %(delays)s::float8[])
     AS o(id, token, state, result, error, delay)
WHERE j.id = o.id AND j.lease_token = o.token AND j.state = 'running'
RETURNING j.id

-- name: job_heartbeat_many
UPDATE {schema}.errands_jobs AS j
SET lease_expires_at = now() + make_interval(secs => o.lease_seconds)
FROM unnest(%(ids)s::bigint[], %(tokens)s::text[], %(leases)s::float8[])
     AS o(id, token, lease_seconds)
WHERE j.id = o.id AND j.lease_token = o.token AND j.state = 'running'
RETURNING j.id, j.cancel_requested

-- name: job_release_many
UPDATE {schema}.errands_jobs AS j
SET state = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'available' END,
    attempt = j.attempt - 1,
    run_at = now(),
    finished_at = CASE WHEN j.cancel_requested THEN now() END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
FROM unnest(%(ids)s::bigint[], %(tokens)s::text[]) AS o(id, token)
WHERE j.id = o.id AND j.lease_token = o.token AND j.state = 'running'
RETURNING j.id

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
       lease_owner
FROM {schema}.errands_jobs
WHERE state = 'running' AND lease_expires_at < now()
ORDER BY lease_expires_at
LIMIT %(limit)s

-- name: job_rescue_many
-- Fenced twice: the token must be the expired claim's, and the lease must still be expired
-- (a heartbeat that landed in between wins).
UPDATE {schema}.errands_jobs AS j
SET state = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE o.state END,
    rescues = j.rescues + 1,
    errors = j.errors || jsonb_build_array(
             o.error::jsonb || jsonb_build_object('at', extract(epoch FROM now()))),
    run_at = now() + make_interval(secs => o.delay),
    finished_at = CASE WHEN j.cancel_requested OR o.state <> 'retryable' THEN now() END,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
FROM unnest(%(ids)s::bigint[], %(tokens)s::text[], %(states)s::text[], %(errors)s::text[],
            %(delays)s::float8[]) AS o(id, token, state, error, delay)
WHERE j.id = o.id AND j.lease_token = o.token AND j.state = 'running'
  AND j.lease_expires_at < now()
RETURNING j.id

-- name: job_promote_due
UPDATE {schema}.errands_jobs
SET state = 'available'
WHERE state IN ('scheduled', 'retryable') AND run_at <= now()

-- name: job_prune
DELETE FROM {schema}.errands_jobs
WHERE id IN (
    SELECT id FROM {schema}.errands_jobs
    WHERE state IN ('completed', 'cancelled', 'discarded')
      AND finished_at < now() - make_interval(secs => %(older_than)s)
    LIMIT %(limit)s
)

-- name: job_get
SELECT {job_columns} FROM {schema}.errands_jobs AS j WHERE j.id = %(id)s

-- name: job_list
SELECT {job_columns}
FROM {schema}.errands_jobs AS j
WHERE (%(state)s::text IS NULL OR j.state = %(state)s::text)
  AND (%(queue)s::text IS NULL OR j.queue = %(queue)s::text)
  AND (%(name)s::text IS NULL OR j.name = %(name)s::text)
  AND (%(before_id)s::bigint IS NULL OR j.id < %(before_id)s::bigint)
ORDER BY j.id DESC
LIMIT %(limit)s

-- name: job_ids_matching
SELECT id FROM {schema}.errands_jobs
WHERE state = %(state)s
  AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
  AND (%(name)s::text IS NULL OR name = %(name)s::text)
ORDER BY id
FOR UPDATE

-- name: job_state_for_update
SELECT state FROM {schema}.errands_jobs WHERE id = %(id)s FOR UPDATE

-- name: queue_stats
SELECT queue, state, count(*),
       extract(epoch FROM now() - min(run_at) FILTER (
           WHERE state IN ('available', 'scheduled', 'retryable') AND run_at <= now()))::float8
FROM {schema}.errands_jobs
GROUP BY queue, state

-- name: job_replay
UPDATE {schema}.errands_jobs
SET state = 'available', attempt = 0, rescues = 0, cancel_requested = false,
    run_at = now(), finished_at = NULL
WHERE id = %(id)s AND state = 'dead'

-- name: job_discard
UPDATE {schema}.errands_jobs
SET state = 'discarded', discarded_by = %(actor)s, discard_reason = %(reason)s,
    finished_at = now()
WHERE id = %(id)s AND state = 'dead'

-- name: job_cancel_pending
UPDATE {schema}.errands_jobs
SET state = 'cancelled', finished_at = now()
WHERE id = %(id)s AND state IN ('available', 'scheduled', 'retryable')

-- name: job_cancel_running
UPDATE {schema}.errands_jobs SET cancel_requested = true
WHERE id = %(id)s AND state = 'running'

-- name: audit_insert
INSERT INTO {schema}.errands_audit (actor, action, job_id, detail)
VALUES (%(actor)s, %(action)s, %(job_id)s, %(detail)s::jsonb)

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
INSERT INTO {schema}.errands_workers (id, host, pid, queues, concurrency, version)
VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s, %(version)s)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()

-- name: worker_heartbeat
UPDATE {schema}.errands_workers
SET heartbeat_at = now(), in_flight = %(in_flight)s, processed = %(processed)s
WHERE id = %(id)s

-- name: worker_deregister
DELETE FROM {schema}.errands_workers WHERE id = %(id)s

-- name: worker_list
SELECT id, host, pid, queues, concurrency, extract(epoch FROM started_at)::float8,
       extract(epoch FROM heartbeat_at)::float8, in_flight, processed, version,
       extract(epoch FROM now() - heartbeat_at)::float8
FROM {schema}.errands_workers
ORDER BY started_at

-- name: worker_prune
DELETE FROM {schema}.errands_workers
WHERE heartbeat_at < now() - make_interval(secs => %(older_than)s)

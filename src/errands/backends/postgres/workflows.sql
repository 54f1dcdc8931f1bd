-- The SQL of workflows (batches, chains, DAGs) on PostgreSQL; the logic that runs it is
-- errands.backends.workflow_store, shared with SQLite. Every fan-in locks the workflow's
-- row first (wf_lock), so the members of one workflow settle one transaction at a time
-- and each sees what the one before it committed (READ COMMITTED: a fresh snapshot per
-- statement). %(ids)s and the other lists are arrays.

-- name: wf_insert
INSERT INTO {schema}.errands_workflows (name, kind, total, callbacks)
VALUES (%(name)s, %(kind)s, %(total)s, %(callbacks)s::jsonb)
RETURNING id

-- name: wf_members_insert
INSERT INTO {schema}.errands_workflow_members (job_id, workflow_id, node)
SELECT j, %(workflow_id)s, n FROM unnest(%(ids)s::bigint[], %(nodes)s::text[]) AS u(j, n)

-- name: wf_pending_insert
INSERT INTO {schema}.errands_workflow_pending (job_id, workflow_id)
SELECT j, %(workflow_id)s FROM unnest(%(ids)s::bigint[]) AS u(j)

-- name: wf_edges_insert
INSERT INTO {schema}.errands_workflow_edges (parent_id, child_id, workflow_id, policy)
SELECT p, c, %(workflow_id)s, k
FROM unnest(%(parents)s::bigint[], %(children)s::bigint[], %(policies)s::text[]) AS u(p, c, k)

-- name: wf_jobs_join
-- Members join their workflow; dependents wait (state waiting, no signal: no claim query
-- and no signal or timeout ever moves them) until their last parent ends.
UPDATE {schema}.errands_jobs
SET workflow_id = %(workflow_id)s,
    state = CASE WHEN id = ANY(%(blocked)s::bigint[]) THEN 'waiting' ELSE state END,
    wait_signal = NULL, wait_until = NULL
WHERE id = ANY(%(ids)s::bigint[])

-- name: wf_add_total
UPDATE {schema}.errands_workflows SET total = total + %(n)s WHERE id = %(id)s

-- name: wf_pending_of
SELECT workflow_id, job_id FROM {schema}.errands_workflow_pending
WHERE job_id = ANY(%(ids)s::bigint[])

-- name: wf_lock
SELECT id FROM {schema}.errands_workflows WHERE id = %(id)s FOR UPDATE

-- name: wf_lock_up
-- The workflows given, those the jobs given are members of, and every workflow these are
-- nested in up to the outermost, locked in id order (the rows are locked as the sort
-- returns them): every fan-in and every operator's write takes its workflows this way,
-- before the rows of their members' dependents. Each with its cancel_requested.
WITH RECURSIVE up(id) AS (
    SELECT unnest(%(workflows)s::bigint[])
    UNION
    SELECT workflow_id FROM {schema}.errands_workflow_members
    WHERE job_id = ANY(%(ids)s::bigint[])
    UNION
    SELECT m.workflow_id FROM {schema}.errands_workflow_members AS m JOIN up ON m.job_id = -up.id
)
SELECT w.id, w.cancel_requested FROM {schema}.errands_workflows AS w
WHERE w.id IN (SELECT id FROM up)
ORDER BY w.id
FOR UPDATE OF w

-- name: wf_leave
-- A member leaves the fan-in set (once: a second delete finds no row).
DELETE FROM {schema}.errands_workflow_pending WHERE job_id = %(id)s
RETURNING workflow_id

-- name: wf_member_outcome
UPDATE {schema}.errands_workflow_members SET outcome = %(outcome)s WHERE job_id = %(id)s

-- name: wf_count
UPDATE {schema}.errands_workflows
SET completed = completed + (%(outcome)s = 'completed')::int,
    dead = dead + (%(outcome)s = 'dead')::int,
    cancelled = cancelled + (%(outcome)s = 'cancelled')::int,
    skipped = skipped + (%(outcome)s = 'skipped')::int
WHERE id = %(id)s

-- name: wf_edges_resolve
UPDATE {schema}.errands_workflow_edges SET outcome = %(outcome)s
WHERE parent_id = %(parent)s AND outcome IS NULL
RETURNING child_id

-- name: wf_edge_open
-- One edge into this dependent whose parent has not ended (errands_workflow_edges_open):
-- none left, and its edges are read once, to decide it.
SELECT 1 FROM {schema}.errands_workflow_edges WHERE child_id = %(child)s AND outcome IS NULL
LIMIT 1

-- name: wf_edges_of_child
SELECT parent_id, policy, outcome FROM {schema}.errands_workflow_edges
WHERE child_id = %(child)s

-- name: wf_release
-- A dependent whose parents all ended runs: now, or its own delay after now (the meta key
-- release_delay), or at its run_at if that is later.
UPDATE {schema}.errands_jobs AS j
SET state = CASE WHEN r.at > now() THEN 'scheduled' ELSE 'available' END, run_at = r.at
FROM (SELECT id, CASE WHEN meta ? 'release_delay'
                      THEN now() + make_interval(secs => (meta->>'release_delay')::float8)
                      ELSE greatest(run_at, now()) END AS at
      FROM {schema}.errands_jobs WHERE id = %(id)s) AS r
WHERE j.id = r.id AND j.state = 'waiting' AND j.wait_signal IS NULL
RETURNING j.queue

-- name: wf_end_blocked
-- A dependent that will not run: cancelled (a parent failed under policy cancel, or the
-- workflow was cancelled) or skipped (policy skip), with the reason in its errors.
UPDATE {schema}.errands_jobs
SET state = 'cancelled', finished_at = now(),
    errors = errors || jsonb_build_array(jsonb_build_object(
        'attempt', attempt, 'type', %(type)s::text, 'message', %(message)s::text,
        'traceback', NULL, 'worker', NULL, 'kind', %(kind)s::text,
        'at', extract(epoch FROM now())))
WHERE id = %(id)s AND state = 'waiting' AND wait_signal IS NULL
RETURNING id

-- name: wf_any_pending
SELECT 1 FROM {schema}.errands_workflow_pending WHERE workflow_id = %(id)s LIMIT 1

-- name: wf_get_row
SELECT id, name, kind, state, total, completed, dead, cancelled, skipped, callbacks::text,
       on_success_job, on_settled_job, on_dead_job, cancel_requested,
       extract(epoch FROM created_at)::float8, extract(epoch FROM settled_at)::float8
FROM {schema}.errands_workflows WHERE id = %(id)s

-- name: wf_settle
UPDATE {schema}.errands_workflows
SET state = %(state)s, settled_at = COALESCE(settled_at, now())
WHERE id = %(id)s

-- name: wf_fired
-- The callback's exactly-once guard: the column is set once, under the workflow's lock.
UPDATE {schema}.errands_workflows
SET on_success_job = CASE WHEN %(event)s::text = 'on_success' THEN %(job)s::bigint ELSE on_success_job END,
    on_settled_job = CASE WHEN %(event)s::text = 'on_settled' THEN %(job)s::bigint ELSE on_settled_job END,
    on_dead_job = CASE WHEN %(event)s::text = 'on_dead' THEN %(job)s::bigint ELSE on_dead_job END
WHERE id = %(id)s

-- name: wf_reenter
-- A replayed dead member is pending again (see docs/workflows.md, "Replaying a member").
INSERT INTO {schema}.errands_workflow_pending (job_id, workflow_id)
SELECT job_id, workflow_id FROM {schema}.errands_workflow_members
WHERE job_id = %(id)s AND outcome = 'dead'
ON CONFLICT DO NOTHING
RETURNING workflow_id

-- name: wf_uncount_dead
UPDATE {schema}.errands_workflows SET dead = dead - 1 WHERE id = %(id)s

-- name: wf_request_cancel
UPDATE {schema}.errands_workflows SET cancel_requested = true
WHERE id = %(id)s AND settled_at IS NULL

-- name: wf_pending_members
SELECT p.job_id, j.state FROM {schema}.errands_workflow_pending AS p
JOIN {schema}.errands_jobs AS j ON j.id = p.job_id
WHERE p.workflow_id = %(id)s
ORDER BY p.job_id

-- name: wf_cancel_member
UPDATE {schema}.errands_jobs
SET state = 'cancelled', finished_at = now(), wait_signal = NULL, wait_until = NULL
WHERE id = %(id)s AND state IN ('available', 'scheduled', 'retryable', 'waiting')
RETURNING id

-- name: wf_cancel_running
UPDATE {schema}.errands_jobs SET cancel_requested = true
WHERE workflow_id = %(id)s AND state = 'running'
  AND id IN (SELECT job_id FROM {schema}.errands_workflow_pending WHERE workflow_id = %(id)s)

-- name: wf_list
SELECT id, name, kind, state, total, completed, dead, cancelled, skipped, callbacks::text,
       on_success_job, on_settled_job, on_dead_job, cancel_requested,
       extract(epoch FROM created_at)::float8, extract(epoch FROM settled_at)::float8
FROM {schema}.errands_workflows
WHERE (%(state)s::text IS NULL OR state = %(state)s::text)
  AND (%(before_id)s::bigint IS NULL OR id < %(before_id)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s

-- name: wf_members
SELECT m.job_id, m.node, j.name, j.state, m.outcome,
       (SELECT coalesce(json_agg(e.parent_id ORDER BY e.parent_id), '[]')::text
        FROM {schema}.errands_workflow_edges AS e WHERE e.child_id = m.job_id)
FROM {schema}.errands_workflow_members AS m
LEFT JOIN {schema}.errands_jobs AS j ON j.id = m.job_id
WHERE m.workflow_id = %(id)s AND m.job_id > %(after)s
ORDER BY m.job_id
LIMIT %(limit)s

-- name: wf_parent_results
SELECT e.parent_id, m.node, COALESCE(j.state, m.outcome), j.result::text, octet_length(j.result::text)
FROM {schema}.errands_workflow_edges AS e
JOIN {schema}.errands_workflow_members AS m ON m.job_id = e.parent_id
LEFT JOIN {schema}.errands_jobs AS j ON j.id = e.parent_id
WHERE e.child_id = %(child)s AND e.parent_id > %(after)s
ORDER BY e.parent_id
LIMIT %(limit)s

-- name: wf_job_state
SELECT state FROM {schema}.errands_jobs WHERE id = %(id)s

-- name: wf_job_workflow
SELECT workflow_id FROM {schema}.errands_jobs WHERE id = %(id)s

-- name: wf_nested_pending
-- The nested workflows still pending in a workflow (members with negative ids).
SELECT -job_id FROM {schema}.errands_workflow_pending WHERE workflow_id = %(id)s AND job_id < 0

-- name: wf_prunable
SELECT id FROM {schema}.errands_workflows
WHERE settled_at IS NOT NULL AND settled_at < now() - make_interval(secs => %(older_than)s)
LIMIT %(limit)s

-- name: wf_delete_edges
DELETE FROM {schema}.errands_workflow_edges WHERE workflow_id = %(id)s

-- name: wf_delete_members
DELETE FROM {schema}.errands_workflow_members WHERE workflow_id = %(id)s

-- name: wf_delete_pending
DELETE FROM {schema}.errands_workflow_pending WHERE workflow_id = %(id)s

-- name: wf_delete
DELETE FROM {schema}.errands_workflows WHERE id = %(id)s

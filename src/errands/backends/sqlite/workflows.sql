-- The SQL of workflows (batches, chains, DAGs) on SQLite; the logic that runs it is
-- errands.backends.workflow_store, shared with PostgreSQL. Every write runs under the
-- file's write lock, so the fan-in of one workflow is never concurrent with another.
-- :ids and the other lists are JSON arrays.

-- name: wf_insert
INSERT INTO errands_workflows (name, kind, total, callbacks, created_at)
VALUES (:name, :kind, :total, :callbacks, (julianday('now') - 2440587.5) * 86400.0)
RETURNING id

-- name: wf_members_insert
INSERT INTO errands_workflow_members (job_id, workflow_id, node)
SELECT j.value, :workflow_id, n.value
FROM json_each(:ids) AS j JOIN json_each(:nodes) AS n ON n.key = j.key

-- name: wf_pending_insert
INSERT INTO errands_workflow_pending (job_id, workflow_id)
SELECT value, :workflow_id FROM json_each(:ids)

-- name: wf_edges_insert
INSERT INTO errands_workflow_edges (parent_id, child_id, workflow_id, policy)
SELECT p.value, c.value, :workflow_id, k.value
FROM json_each(:parents) AS p
JOIN json_each(:children) AS c ON c.key = p.key
JOIN json_each(:policies) AS k ON k.key = p.key

-- name: wf_jobs_join
-- Members join their workflow; dependents wait (state waiting, no signal: no claim query
-- and no signal or timeout ever moves them) until their last parent ends.
UPDATE errands_jobs
SET workflow_id = :workflow_id,
    state = CASE WHEN id IN (SELECT value FROM json_each(:blocked)) THEN 'waiting' ELSE state END,
    wait_signal = NULL, wait_until = NULL
WHERE id IN (SELECT value FROM json_each(:ids))

-- name: wf_add_total
UPDATE errands_workflows SET total = total + :n WHERE id = :id

-- name: wf_pending_of
SELECT workflow_id, job_id FROM errands_workflow_pending
WHERE job_id IN (SELECT value FROM json_each(:ids))

-- name: wf_lock
SELECT id FROM errands_workflows WHERE id = :id

-- name: wf_lock_up
-- The workflows given, those the jobs given are members of, and every workflow these are
-- nested in up to the outermost, in id order, each with its cancel_requested (the file's
-- write lock is the lock: PostgreSQL locks these rows in this order).
WITH RECURSIVE up(id) AS (
    SELECT value FROM json_each(:workflows)
    UNION
    SELECT workflow_id FROM errands_workflow_members
    WHERE job_id IN (SELECT value FROM json_each(:ids))
    UNION
    SELECT m.workflow_id FROM errands_workflow_members AS m JOIN up ON m.job_id = -up.id
)
SELECT w.id, w.cancel_requested FROM errands_workflows AS w
WHERE w.id IN (SELECT id FROM up)
ORDER BY w.id

-- name: wf_leave
-- A member leaves the fan-in set (once: a second delete finds no row).
DELETE FROM errands_workflow_pending WHERE job_id = :id
RETURNING workflow_id

-- name: wf_member_outcome
UPDATE errands_workflow_members SET outcome = :outcome WHERE job_id = :id

-- name: wf_count
UPDATE errands_workflows
SET completed = completed + (:outcome = 'completed'),
    dead = dead + (:outcome = 'dead'),
    cancelled = cancelled + (:outcome = 'cancelled'),
    skipped = skipped + (:outcome = 'skipped')
WHERE id = :id

-- name: wf_edges_resolve
UPDATE errands_workflow_edges SET outcome = :outcome
WHERE parent_id = :parent AND outcome IS NULL
RETURNING child_id

-- name: wf_edge_open
-- One edge into this dependent whose parent has not ended (errands_workflow_edges_open):
-- none left, and its edges are read once, to decide it.
SELECT 1 FROM errands_workflow_edges WHERE child_id = :child AND outcome IS NULL
LIMIT 1

-- name: wf_edges_of_child
SELECT parent_id, policy, outcome FROM errands_workflow_edges WHERE child_id = :child

-- name: wf_release
-- A dependent whose parents all ended runs: now, or its own delay after now (the meta key
-- release_delay), or at its run_at if that is later.
UPDATE errands_jobs
SET state = CASE WHEN r.at > r.now THEN 'scheduled' ELSE 'available' END, run_at = r.at
FROM (SELECT now, CASE WHEN delay IS NOT NULL THEN now + delay ELSE max(run_at, now) END AS at
      FROM (SELECT (julianday('now') - 2440587.5) * 86400.0 AS now,
                   json_extract(meta, '$.release_delay') AS delay, run_at
            FROM errands_jobs WHERE id = :id)) AS r
WHERE id = :id AND state = 'waiting' AND wait_signal IS NULL
RETURNING queue

-- name: wf_end_blocked
-- A dependent that will not run: cancelled (a parent failed under policy cancel, or the
-- workflow was cancelled) or skipped (policy skip), with the reason in its errors.
UPDATE errands_jobs
SET state = 'cancelled', finished_at = (julianday('now') - 2440587.5) * 86400.0,
    errors = json_insert(errors, '$[#]', json_object(
        'attempt', attempt, 'type', :type, 'message', :message, 'traceback', NULL,
        'worker', NULL, 'kind', :kind, 'at', (julianday('now') - 2440587.5) * 86400.0))
WHERE id = :id AND state = 'waiting' AND wait_signal IS NULL
RETURNING id

-- name: wf_any_pending
SELECT 1 FROM errands_workflow_pending WHERE workflow_id = :id LIMIT 1

-- name: wf_get_row
SELECT id, name, kind, state, total, completed, dead, cancelled, skipped, callbacks,
       on_success_job, on_settled_job, on_dead_job, cancel_requested, created_at, settled_at
FROM errands_workflows WHERE id = :id

-- name: wf_settle
UPDATE errands_workflows
SET state = :state, settled_at = COALESCE(settled_at, (julianday('now') - 2440587.5) * 86400.0)
WHERE id = :id

-- name: wf_fired
-- The callback's exactly-once guard: the column is set once, under the workflow's lock.
UPDATE errands_workflows
SET on_success_job = CASE WHEN :event = 'on_success' THEN :job ELSE on_success_job END,
    on_settled_job = CASE WHEN :event = 'on_settled' THEN :job ELSE on_settled_job END,
    on_dead_job = CASE WHEN :event = 'on_dead' THEN :job ELSE on_dead_job END
WHERE id = :id

-- name: wf_reenter
-- A replayed dead member is pending again (see docs/workflows.md, "Replaying a member").
INSERT INTO errands_workflow_pending (job_id, workflow_id)
SELECT job_id, workflow_id FROM errands_workflow_members
WHERE job_id = :id AND outcome = 'dead'
ON CONFLICT DO NOTHING
RETURNING workflow_id

-- name: wf_uncount_dead
UPDATE errands_workflows SET dead = dead - 1 WHERE id = :id

-- name: wf_request_cancel
UPDATE errands_workflows SET cancel_requested = 1 WHERE id = :id AND settled_at IS NULL

-- name: wf_pending_members
SELECT p.job_id, j.state FROM errands_workflow_pending AS p
JOIN errands_jobs AS j ON j.id = p.job_id
WHERE p.workflow_id = :id
ORDER BY p.job_id

-- name: wf_cancel_member
UPDATE errands_jobs
SET state = 'cancelled', finished_at = (julianday('now') - 2440587.5) * 86400.0,
    wait_signal = NULL, wait_until = NULL
WHERE id = :id AND state IN ('available', 'scheduled', 'retryable', 'waiting')
RETURNING id

-- name: wf_cancel_running
UPDATE errands_jobs SET cancel_requested = 1
WHERE workflow_id = :id AND state = 'running'
  AND id IN (SELECT job_id FROM errands_workflow_pending WHERE workflow_id = :id)

-- name: wf_list
SELECT id, name, kind, state, total, completed, dead, cancelled, skipped, callbacks,
       on_success_job, on_settled_job, on_dead_job, cancel_requested, created_at, settled_at
FROM errands_workflows
WHERE (:state IS NULL OR state = :state) AND (:before_id IS NULL OR id < :before_id)
ORDER BY id DESC
LIMIT :limit

-- name: wf_members
SELECT m.job_id, m.node, j.name, j.state, m.outcome,
       (SELECT json_group_array(e.parent_id) FROM errands_workflow_edges AS e
        WHERE e.child_id = m.job_id)
FROM errands_workflow_members AS m
LEFT JOIN errands_jobs AS j ON j.id = m.job_id
WHERE m.workflow_id = :id AND m.job_id > :after
ORDER BY m.job_id
LIMIT :limit

-- name: wf_parent_results
SELECT e.parent_id, m.node, COALESCE(j.state, m.outcome), j.result, length(CAST(j.result AS BLOB))
FROM errands_workflow_edges AS e
JOIN errands_workflow_members AS m ON m.job_id = e.parent_id
LEFT JOIN errands_jobs AS j ON j.id = e.parent_id
WHERE e.child_id = :child AND e.parent_id > :after
ORDER BY e.parent_id
LIMIT :limit

-- name: wf_job_state
SELECT state FROM errands_jobs WHERE id = :id

-- name: wf_job_workflow
SELECT workflow_id FROM errands_jobs WHERE id = :id

-- name: wf_nested_pending
-- The nested workflows still pending in a workflow (members with negative ids).
SELECT -job_id FROM errands_workflow_pending WHERE workflow_id = :id AND job_id < 0

-- name: wf_prunable
SELECT id FROM errands_workflows
WHERE settled_at IS NOT NULL
  AND settled_at < (julianday('now') - 2440587.5) * 86400.0 - :older_than
LIMIT :limit

-- name: wf_delete_edges
DELETE FROM errands_workflow_edges WHERE workflow_id = :id

-- name: wf_delete_members
DELETE FROM errands_workflow_members WHERE workflow_id = :id

-- name: wf_delete_pending
DELETE FROM errands_workflow_pending WHERE workflow_id = :id

-- name: wf_delete
DELETE FROM errands_workflows WHERE id = :id

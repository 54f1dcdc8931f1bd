-- The SQL of workflows (batches, chains, DAGs) on SQLite; the logic that runs it is
-- errands.backends.workflow_store, shared with PostgreSQL. Every write runs under the
-- file's write lock, so the fan-in of one workflow is never concurrent with another.
-- :ids and the other lists are JSON arrays.

-- name: wf_insert
INSERT INTO errands_workflows (name, kind, total, callbacks, created_at)
VALUES (:name, :kind, :total, :callbacks, (julianday('now') - 2440587.5) * 86400.0)
RETURNING id

-- name: wf_members_insert
-- :rows is [[job_id, node], ...] (one json_each: a join of two on their keys has no index).
INSERT INTO errands_workflow_members (job_id, workflow_id, node)
SELECT json_extract(value, '$[0]'), :workflow_id, json_extract(value, '$[1]')
FROM json_each(:rows)

-- name: wf_pending_insert
INSERT INTO errands_workflow_pending (job_id, workflow_id)
SELECT value, :workflow_id FROM json_each(:ids)

-- name: wf_edges_insert
-- :rows is [[parent_id, child_id, policy], ...].
INSERT INTO errands_workflow_edges (parent_id, child_id, workflow_id, policy)
SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), :workflow_id,
       json_extract(value, '$[2]')
FROM json_each(:rows)

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

-- name: wf_lock_pending
-- A fan-in's first statement: the workflows the jobs given are pending in, and every
-- workflow these are nested in up to the outermost, in id order (the file's write lock
-- is the lock); no row when none of the jobs is pending (a job outside workflows, a second
-- delivery of an end already counted). Each with its cancel_requested and kind.
WITH RECURSIVE up(id) AS (
    SELECT workflow_id FROM errands_workflow_pending
    WHERE job_id IN (SELECT value FROM json_each(:ids))
    UNION
    SELECT m.workflow_id FROM errands_workflow_members AS m JOIN up ON m.job_id = -up.id
)
SELECT w.id, w.cancel_requested, w.kind FROM errands_workflows AS w
WHERE w.id IN (SELECT id FROM up)
ORDER BY w.id

-- name: wf_leave_ended
-- The members given that ended leave the fan-in set, once (a second delete finds no row),
-- each with its workflow and its job's state; a job not ended (a retry) stays. Nested
-- workflows (negative ids, no job) leave as given.
DELETE FROM errands_workflow_pending
WHERE job_id IN (SELECT value FROM json_each(:ids))
  AND (job_id < 0 OR EXISTS (SELECT 1 FROM errands_jobs AS j
                             WHERE j.id = errands_workflow_pending.job_id
                               AND j.state IN (SELECT value FROM json_each(:ended))))
RETURNING job_id, workflow_id,
          (SELECT j.state FROM errands_jobs AS j WHERE j.id = errands_workflow_pending.job_id)

-- name: wf_member_outcomes
-- :rows is [[job_id, outcome], ...].
UPDATE errands_workflow_members SET outcome = u.o
FROM (SELECT json_extract(value, '$[0]') AS j, json_extract(value, '$[1]') AS o
      FROM json_each(:rows)) AS u
WHERE errands_workflow_members.job_id = u.j

-- name: wf_count_many
-- Each workflow's counts by outcome, moved by the members that just ended in it; its row
-- as they leave it (wf_settle_row's columns: with whether a member is still pending).
-- :rows is [[workflow_id, completed, dead, cancelled, skipped], ...].
UPDATE errands_workflows
SET completed = completed + u.c, dead = dead + u.d, cancelled = cancelled + u.x,
    skipped = skipped + u.s
FROM (SELECT json_extract(value, '$[0]') AS wid, json_extract(value, '$[1]') AS c,
             json_extract(value, '$[2]') AS d, json_extract(value, '$[3]') AS x,
             json_extract(value, '$[4]') AS s
      FROM json_each(:rows)) AS u
WHERE errands_workflows.id = u.wid
RETURNING id, name, kind, state, total, completed, dead, cancelled, skipped, callbacks,
          on_success_job, on_settled_job, on_dead_job, cancel_requested, created_at,
          settled_at,
          EXISTS (SELECT 1 FROM errands_workflow_pending AS p
                  WHERE p.workflow_id = errands_workflows.id)

-- name: wf_edges_resolve_many
-- The edges out of the members that just ended carry their outcomes; their dependents.
-- :rows is [[parent_id, outcome], ...].
UPDATE errands_workflow_edges SET outcome = u.o
FROM (SELECT json_extract(value, '$[0]') AS p, json_extract(value, '$[1]') AS o
      FROM json_each(:rows)) AS u
WHERE errands_workflow_edges.parent_id = u.p AND errands_workflow_edges.outcome IS NULL
RETURNING child_id

-- name: wf_ready_edges
-- Of the dependents given, those with no open edge left (asked through
-- errands_workflow_edges_open, which holds only the edges whose parent has not ended):
-- every edge into each, read once, to decide it. A dependent still waiting for a parent
-- costs one index probe, however many parents it has.
WITH ready AS MATERIALIZED (
    SELECT c.value AS id FROM json_each(:children) AS c
    WHERE NOT EXISTS (SELECT 1 FROM errands_workflow_edges AS o
                      WHERE o.child_id = c.value AND o.outcome IS NULL)
)
SELECT e.child_id, e.workflow_id, e.parent_id, e.policy, e.outcome
FROM ready JOIN errands_workflow_edges AS e ON e.child_id = ready.id
ORDER BY e.child_id, e.parent_id

-- name: wf_release_many
-- Dependents whose parents all ended run: now, or their own delay after now (the meta key
-- release_delay), or at their run_at if that is later. Their queues (one row each).
UPDATE errands_jobs
SET state = CASE WHEN r.at > r.now THEN 'scheduled' ELSE 'available' END, run_at = r.at
FROM (SELECT rid, now,
             CASE WHEN delay IS NOT NULL THEN now + delay ELSE max(run_at, now) END AS at
      FROM (SELECT id AS rid, (julianday('now') - 2440587.5) * 86400.0 AS now,
                   json_extract(meta, '$.release_delay') AS delay, run_at
            FROM errands_jobs WHERE id IN (SELECT value FROM json_each(:ids)))) AS r
WHERE errands_jobs.id = r.rid AND state = 'waiting' AND wait_signal IS NULL
RETURNING queue

-- name: wf_end_blocked_many
-- Dependents that will not run: cancelled (a parent failed under policy cancel, or the
-- workflow was cancelled) or skipped (policy skip), each with its reason in its errors.
-- :rows is [[job_id, type, kind, message], ...].
UPDATE errands_jobs
SET state = 'cancelled', finished_at = (julianday('now') - 2440587.5) * 86400.0,
    errors = json_insert(errors, '$[#]', json_object(
        'attempt', attempt, 'type', u.t, 'message', u.m, 'traceback', NULL,
        'worker', NULL, 'kind', u.k, 'at', (julianday('now') - 2440587.5) * 86400.0))
FROM (SELECT json_extract(value, '$[0]') AS jid, json_extract(value, '$[1]') AS t,
             json_extract(value, '$[2]') AS k, json_extract(value, '$[3]') AS m
      FROM json_each(:rows)) AS u
WHERE errands_jobs.id = u.jid AND state = 'waiting' AND wait_signal IS NULL
RETURNING id

-- name: wf_note_cancelled
-- Members that ended cancelled while their workflow's cancel was requested (the pending
-- ones its cancel ended; running ones it asked to stop, once they end): "the workflow was
-- cancelled" in their errors, as wf_end_blocked_many writes it for the dependents and
-- added members it cancels, once (those already saying so are left as they are).
UPDATE errands_jobs
SET errors = json_insert(errors, '$[#]', json_object(
        'attempt', attempt, 'type', 'Cancelled', 'message', :message, 'traceback', NULL,
        'worker', NULL, 'kind', 'cancelled', 'at', (julianday('now') - 2440587.5) * 86400.0))
WHERE id IN (SELECT value FROM json_each(:ids)) AND state = 'cancelled'
  AND NOT EXISTS (SELECT 1 FROM json_each(errands_jobs.errors) AS e
                  WHERE json_extract(e.value, '$.kind') = 'cancelled'
                    AND json_extract(e.value, '$.message') = :message)

-- name: wf_get_row
SELECT id, name, kind, state, total, completed, dead, cancelled, skipped, callbacks,
       on_success_job, on_settled_job, on_dead_job, cancel_requested, created_at, settled_at
FROM errands_workflows WHERE id = :id

-- name: wf_settle_row
-- The workflow's row (as wf_get_row), and whether a member is still pending.
SELECT w.id, w.name, w.kind, w.state, w.total, w.completed, w.dead, w.cancelled, w.skipped,
       w.callbacks, w.on_success_job, w.on_settled_job, w.on_dead_job, w.cancel_requested,
       w.created_at, w.settled_at,
       EXISTS (SELECT 1 FROM errands_workflow_pending AS p WHERE p.workflow_id = w.id)
FROM errands_workflows AS w WHERE w.id = :id

-- name: wf_settle_fire
-- A workflow settles (in :state; NULL: unchanged) and records the callback jobs just
-- inserted (NULL: none). Each callback column is set once, under the workflow's lock:
-- the callback's exactly-once guard. settled_at is when it last settled (:settled:
-- nothing pending now): a workflow settled again after a replay counts its retention
-- from then, or it was pruned right away with the callbacks just fired reading it.
UPDATE errands_workflows
SET state = COALESCE(:state, state),
    settled_at = CASE WHEN :settled THEN (julianday('now') - 2440587.5) * 86400.0
                      ELSE settled_at END,
    on_success_job = COALESCE(:on_success, on_success_job),
    on_settled_job = COALESCE(:on_settled, on_settled_job),
    on_dead_job = COALESCE(:on_dead, on_dead_job)
WHERE id = :id

-- name: wf_members_among
-- Which of the jobs given (:ids, a JSON list) are workflow members.
SELECT job_id FROM errands_workflow_members
WHERE job_id IN (SELECT value FROM json_each(:ids))

-- name: wf_dead_callbacks_among
-- Of the jobs given, the dead workflow callbacks, with their workflow and event (see the
-- PostgreSQL statement). A meta that is not JSON (a raw row) is no callback's: read
-- through json_valid, it made json_extract fail the whole replay ('malformed JSON').
SELECT id, json_extract(m, '$.workflow_callback.workflow'),
       json_extract(m, '$.workflow_callback.event')
FROM (SELECT id, CASE WHEN json_valid(meta) THEN meta END AS m FROM errands_jobs
      WHERE id IN (SELECT value FROM json_each(:ids)) AND state = 'dead')
WHERE json_extract(m, '$.workflow_callback') IS NOT NULL

-- name: wf_existing
SELECT id FROM errands_workflows WHERE id IN (SELECT value FROM json_each(:ids))

-- name: wf_cancelled_among
-- Of the jobs given (:ids, a JSON list), the members of a workflow whose cancel was
-- requested, or of one nested in such a workflow at any depth, each with the nearest
-- such workflow (see the PostgreSQL statement; SQLite takes the bare column from the
-- row of min(depth)).
WITH RECURSIVE up(job_id, id, depth) AS (
    SELECT job_id, workflow_id, 0 FROM errands_workflow_members
    WHERE job_id IN (SELECT value FROM json_each(:ids))
    UNION ALL
    SELECT up.job_id, m.workflow_id, up.depth + 1
    FROM up JOIN errands_workflow_members AS m ON m.job_id = -up.id
)
SELECT up.job_id, up.id, min(up.depth)
FROM up JOIN errands_workflows AS w ON w.id = up.id
WHERE w.cancel_requested
GROUP BY up.job_id
ORDER BY up.job_id

-- name: wf_reenter
-- Replayed dead members (job ids, or minus nested workflows' ids; :ids a JSON list) are
-- pending again (see docs/workflows.md, "Replaying a member"): each one made pending, with
-- its workflow.
INSERT INTO errands_workflow_pending (job_id, workflow_id)
SELECT job_id, workflow_id FROM errands_workflow_members
WHERE job_id IN (SELECT value FROM json_each(:ids)) AND outcome = 'dead'
ON CONFLICT DO NOTHING
RETURNING job_id, workflow_id

-- name: wf_reopen_edges
-- A replayed dead member's edges to dependents still waiting (for another parent) are
-- open again: they wait for its new end (see the PostgreSQL statement).
UPDATE errands_workflow_edges SET outcome = NULL
WHERE parent_id IN (SELECT value FROM json_each(:ids)) AND outcome = 'dead'
  AND EXISTS (SELECT 1 FROM errands_jobs AS c
              WHERE c.id = errands_workflow_edges.child_id AND c.state = 'waiting'
                AND c.wait_signal IS NULL)

-- name: wf_request_cancel
-- The workflow and every workflow nested in it, in one statement (see PostgreSQL's):
-- those not settled, and those settled that a replay re-opened (a member pending again).
UPDATE errands_workflows SET cancel_requested = 1
WHERE (settled_at IS NULL OR EXISTS (
          SELECT 1 FROM errands_workflow_pending AS p
          WHERE p.workflow_id = errands_workflows.id))
  AND id IN (
    WITH RECURSIVE tree(id) AS (
        SELECT :id
        UNION
        SELECT -m.job_id FROM errands_workflow_members AS m
        JOIN tree ON m.workflow_id = tree.id
        WHERE m.job_id < 0
    )
    SELECT id FROM tree
)

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
-- A parent's state, 'skipped' for a skipped one (see the PostgreSQL statement).
SELECT e.parent_id, m.node,
       CASE WHEN m.outcome = 'skipped' THEN m.outcome ELSE COALESCE(j.state, m.outcome) END,
       j.result, length(CAST(j.result AS BLOB))
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
-- Settled before the retention, nested in no other, nothing pending in it nor in a
-- workflow nested in it at any depth, and no callback of theirs yet to end or dead (a
-- replay from the DLQ runs it again); oldest first (see the PostgreSQL statement).
SELECT id FROM errands_workflows AS w
WHERE settled_at IS NOT NULL
  AND settled_at < (julianday('now') - 2440587.5) * 86400.0 - :older_than
  AND (:root IS NULL OR w.id = :root)  -- one asked again, locked
  AND NOT EXISTS (SELECT 1 FROM errands_workflow_members AS m WHERE m.job_id = -w.id)
  AND NOT EXISTS (
      WITH RECURSIVE tree(id) AS (
          SELECT w.id
          UNION
          SELECT -m.job_id FROM errands_workflow_members AS m
          JOIN tree ON m.workflow_id = tree.id AND m.job_id < 0
      )
      SELECT 1 FROM errands_workflow_pending AS p
      WHERE p.workflow_id IN (SELECT id FROM tree)
      UNION ALL
      SELECT 1 FROM tree
      JOIN errands_workflows AS t ON t.id = tree.id
      JOIN errands_jobs AS j ON j.id IN (t.on_success_job, t.on_settled_job, t.on_dead_job)
      WHERE j.state NOT IN ('completed', 'cancelled', 'discarded'))
ORDER BY settled_at
LIMIT :limit

-- name: wf_nested
SELECT -job_id FROM errands_workflow_members WHERE workflow_id = :id AND job_id < 0

-- name: wf_tree_rows
-- The edge and member rows of these workflows (see the PostgreSQL statement).
SELECT (SELECT count(*) FROM errands_workflow_edges
        WHERE workflow_id IN (SELECT value FROM json_each(:ids)))
     + (SELECT count(*) FROM errands_workflow_members
        WHERE workflow_id IN (SELECT value FROM json_each(:ids)))

-- name: wf_delete_edges
-- Through errands_workflow_edges_workflow (migration 16): without it, each workflow pruned
-- read every edge of every workflow kept, under the write lock.
DELETE FROM errands_workflow_edges WHERE workflow_id = :id

-- name: wf_delete_members
DELETE FROM errands_workflow_members WHERE workflow_id = :id

-- name: wf_delete_pending
DELETE FROM errands_workflow_pending WHERE workflow_id = :id

-- name: wf_delete
DELETE FROM errands_workflows WHERE id = :id

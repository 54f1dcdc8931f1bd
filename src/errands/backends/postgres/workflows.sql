-- The SQL of workflows (batches, chains, DAGs) on PostgreSQL; the logic that runs it is
-- errands.backends.workflow_store, shared with SQLite. Every fan-in locks the workflow's
-- row first (wf_lock_pending), so the members of one workflow settle one transaction at a
-- time and each sees what the one before it committed (READ COMMITTED: a fresh snapshot
-- per statement). %(ids)s and the other lists are arrays. A fan-in is set-based: a
-- handful of statements per finish, however many members end in it and however many
-- dependents they release.

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
-- before the rows of their members' dependents. Each with its cancel_requested. (The
-- start is one array, whatever the number of jobs: the planner's estimate of the
-- recursion stays small, and no JIT compilation is paid for a few index probes.)
WITH RECURSIVE up(id) AS (
    SELECT unnest(%(workflows)s::bigint[] || ARRAY(
        SELECT workflow_id FROM {schema}.errands_workflow_members
        WHERE job_id = ANY(%(ids)s::bigint[])))
    UNION
    SELECT (SELECT m.workflow_id FROM {schema}.errands_workflow_members AS m
            WHERE m.job_id = -up.id)
    FROM up WHERE up.id IS NOT NULL
)
SELECT w.id, w.cancel_requested FROM {schema}.errands_workflows AS w
WHERE w.id = ANY(ARRAY(SELECT id FROM up))
ORDER BY w.id
FOR UPDATE OF w

-- name: wf_lock_pending
-- A fan-in's first statement: the workflows the jobs given are pending in, and every
-- workflow these are nested in up to the outermost, locked in id order as wf_lock_up
-- locks them; no row when none of the jobs is pending (a job outside workflows, a second
-- delivery of an end already counted). Each with its cancel_requested and kind. (The
-- start is one array, as in wf_lock_up: 300 jobs do not make a recursion the planner
-- estimates at 250,000, which costs a JIT compilation of 6 to 15 ms each time.)
WITH RECURSIVE up(id) AS (
    SELECT unnest(ARRAY(SELECT DISTINCT workflow_id FROM {schema}.errands_workflow_pending
                        WHERE job_id = ANY(%(ids)s::bigint[])))
    UNION
    SELECT (SELECT m.workflow_id FROM {schema}.errands_workflow_members AS m
            WHERE m.job_id = -up.id)
    FROM up WHERE up.id IS NOT NULL
)
SELECT w.id, w.cancel_requested, w.kind FROM {schema}.errands_workflows AS w
WHERE w.id = ANY(ARRAY(SELECT id FROM up))
ORDER BY w.id
FOR UPDATE OF w

-- name: wf_leave_ended
-- The members given that ended leave the fan-in set, once (a second delete finds no row),
-- each with its workflow and its job's state; a job not ended (a retry) stays. Nested
-- workflows (negative ids, no job) leave as given.
-- (The job's state is a scalar subquery, one index probe per member: an EXISTS here may
-- be planned as a hash of every ended job in the table.)
DELETE FROM {schema}.errands_workflow_pending AS p
WHERE p.job_id = ANY(%(ids)s::bigint[])
  AND (p.job_id < 0 OR (SELECT j.state FROM {schema}.errands_jobs AS j WHERE j.id = p.job_id)
                       = ANY(%(ended)s::text[]))
RETURNING p.job_id, p.workflow_id,
          (SELECT j.state FROM {schema}.errands_jobs AS j WHERE j.id = p.job_id)

-- name: wf_member_outcomes
UPDATE {schema}.errands_workflow_members AS m SET outcome = u.o
FROM unnest(%(ids)s::bigint[], %(outcomes)s::text[]) AS u(j, o)
WHERE m.job_id = u.j AND m.job_id = ANY(%(ids)s::bigint[])  -- by index, whatever the stats

-- name: wf_count_many
-- Each workflow's counts by outcome, moved by the members that just ended in it; its row
-- as they leave it (wf_settle_row's columns: with whether a member is still pending).
UPDATE {schema}.errands_workflows AS w
SET completed = w.completed + u.c, dead = w.dead + u.d,
    cancelled = w.cancelled + u.x, skipped = w.skipped + u.s
FROM unnest(%(ids)s::bigint[], %(completed)s::int[], %(dead)s::int[],
            %(cancelled)s::int[], %(skipped)s::int[]) AS u(id, c, d, x, s)
WHERE w.id = u.id AND w.id = ANY(%(ids)s::bigint[])
RETURNING w.id, w.name, w.kind, w.state, w.total, w.completed, w.dead, w.cancelled,
          w.skipped, w.callbacks::text, w.on_success_job, w.on_settled_job, w.on_dead_job,
          w.cancel_requested, extract(epoch FROM w.created_at)::float8,
          extract(epoch FROM w.settled_at)::float8,
          EXISTS (SELECT 1 FROM {schema}.errands_workflow_pending AS p
                  WHERE p.workflow_id = w.id)

-- name: wf_leave_count
-- wf_leave_ended, wf_member_outcomes and wf_count_many in one statement (PostgreSQL only:
-- the fan-in uses it when the backend's queries have it; one round trip instead of
-- three per finish that ends members). The members given that ended leave the pending
-- set; each gets its outcome (the one forced for it, else its job's state, a discarded
-- job counting as dead); each workflow's counts move by them. One row per workflow, as
-- wf_count_many returns it, and its members that ended now, [[member, outcome], ...].
-- Every part reads the snapshot from before the statement's own writes, so "a member is
-- still pending" leaves out the rows this statement deleted.
WITH left_set AS (
    DELETE FROM {schema}.errands_workflow_pending AS p
    WHERE p.job_id = ANY(%(ids)s::bigint[])
      AND (p.job_id < 0 OR (SELECT j.state FROM {schema}.errands_jobs AS j
                            WHERE j.id = p.job_id) = ANY(%(ended)s::text[]))
    RETURNING p.job_id, p.workflow_id,
              (SELECT j.state FROM {schema}.errands_jobs AS j WHERE j.id = p.job_id) AS state
),
ended AS MATERIALIZED (
    SELECT l.job_id, l.workflow_id,
           COALESCE(g.forced, CASE WHEN l.state = 'discarded' THEN 'dead' ELSE l.state END)
               AS outcome
    FROM left_set AS l
    JOIN unnest(%(ids)s::bigint[], %(forced)s::text[]) AS g(id, forced) ON g.id = l.job_id
),
outcomes AS (
    UPDATE {schema}.errands_workflow_members AS m SET outcome = e.outcome
    FROM ended AS e
    WHERE m.job_id = e.job_id AND m.job_id = ANY(%(ids)s::bigint[])  -- by index
),
counts AS (
    SELECT workflow_id AS id,
           (count(*) FILTER (WHERE outcome = 'completed'))::int AS c,
           (count(*) FILTER (WHERE outcome = 'dead'))::int AS d,
           (count(*) FILTER (WHERE outcome = 'cancelled'))::int AS x,
           (count(*) FILTER (WHERE outcome = 'skipped'))::int AS s,
           jsonb_agg(jsonb_build_array(job_id, outcome) ORDER BY job_id)::text AS members
    FROM ended GROUP BY workflow_id
)
UPDATE {schema}.errands_workflows AS w
SET completed = w.completed + u.c, dead = w.dead + u.d,
    cancelled = w.cancelled + u.x, skipped = w.skipped + u.s
FROM counts AS u
WHERE w.id = u.id
RETURNING w.id, w.name, w.kind, w.state, w.total, w.completed, w.dead, w.cancelled,
          w.skipped, w.callbacks::text, w.on_success_job, w.on_settled_job, w.on_dead_job,
          w.cancel_requested, extract(epoch FROM w.created_at)::float8,
          extract(epoch FROM w.settled_at)::float8,
          EXISTS (SELECT 1 FROM {schema}.errands_workflow_pending AS p
                  WHERE p.workflow_id = w.id
                    AND p.job_id <> ALL (ARRAY(SELECT job_id FROM left_set))),
          u.members

-- name: wf_resolve_ready
-- wf_edges_resolve_many and wf_ready_edges in one statement (PostgreSQL only, as
-- wf_leave_count): the edges out of the members that just ended carry their outcomes;
-- of their dependents, those with no open edge left, with every edge into each. The reads
-- see the edges as they were before this statement's update, so the edges it resolves
-- are left out of "open" and their outcomes taken from its RETURNING.
WITH resolved AS (
    UPDATE {schema}.errands_workflow_edges AS e SET outcome = u.o
    FROM unnest(%(parents)s::bigint[], %(outcomes)s::text[]) AS u(p, o)
    WHERE e.parent_id = u.p AND e.parent_id = ANY(%(parents)s::bigint[]) AND e.outcome IS NULL
    RETURNING e.child_id, e.parent_id, e.outcome
),
ready AS MATERIALIZED (
    SELECT c.id FROM (SELECT DISTINCT child_id AS id FROM resolved) AS c
    WHERE (SELECT 1 FROM {schema}.errands_workflow_edges AS o
           WHERE o.child_id = c.id AND o.outcome IS NULL
             AND o.parent_id <> ALL (ARRAY(SELECT r.parent_id FROM resolved AS r
                                           WHERE r.child_id = c.id))
           LIMIT 1) IS NULL
)
SELECT ready.id, e.workflow_id, e.parent_id, e.policy, COALESCE(r.outcome, e.outcome)
FROM ready CROSS JOIN LATERAL (
    SELECT workflow_id, parent_id, policy, outcome FROM {schema}.errands_workflow_edges
    WHERE child_id = ready.id ORDER BY parent_id
) AS e
LEFT JOIN resolved AS r ON r.child_id = ready.id AND r.parent_id = e.parent_id
ORDER BY ready.id, e.parent_id

-- name: wf_edges_resolve_many
-- The edges out of the members that just ended carry their outcomes; their dependents.
UPDATE {schema}.errands_workflow_edges AS e SET outcome = u.o
FROM unnest(%(parents)s::bigint[], %(outcomes)s::text[]) AS u(p, o)
WHERE e.parent_id = u.p AND e.parent_id = ANY(%(parents)s::bigint[]) AND e.outcome IS NULL
RETURNING e.child_id

-- name: wf_ready_edges
-- Of the dependents given, those with no open edge left (asked through
-- errands_workflow_edges_open, which holds only the edges whose parent has not ended):
-- every edge into each, read once, to decide it. A dependent still waiting for a parent
-- costs one index probe, however many parents it has. (The probe and the read are
-- correlated subqueries, one index scan per dependent: never a scan of all the edges,
-- whatever the planner's statistics say.)
WITH ready AS MATERIALIZED (
    SELECT c.id FROM unnest(%(children)s::bigint[]) AS c(id)
    WHERE (SELECT 1 FROM {schema}.errands_workflow_edges AS o
           WHERE o.child_id = c.id AND o.outcome IS NULL LIMIT 1) IS NULL
)
SELECT ready.id, e.workflow_id, e.parent_id, e.policy, e.outcome
FROM ready CROSS JOIN LATERAL (
    SELECT workflow_id, parent_id, policy, outcome FROM {schema}.errands_workflow_edges
    WHERE child_id = ready.id ORDER BY parent_id
) AS e

-- name: wf_release_many
-- Dependents whose parents all ended run: now, or their own delay after now (the meta key
-- release_delay), or at their run_at if that is later. Their queues (one row each), each
-- queue NOTIFYed once on %(channel)s in the same statement unless this process NOTIFYed it
-- within its window (%(recent)s; coalesced as an enqueue's): a chain step's finish saves a
-- round trip. The wake-up is sent at commit, as any NOTIFY.
WITH released AS (
UPDATE {schema}.errands_jobs AS j
SET state = CASE WHEN r.at > now() THEN 'scheduled' ELSE 'available' END, run_at = r.at
FROM (SELECT id, CASE WHEN meta ? 'release_delay'
                      THEN now() + make_interval(secs => (meta->>'release_delay')::float8)
                      ELSE greatest(run_at, now()) END AS at
      FROM {schema}.errands_jobs WHERE id = ANY(%(ids)s::bigint[])) AS r
WHERE j.id = r.id AND j.id = ANY(%(ids)s::bigint[]) AND j.state = 'waiting'
  AND j.wait_signal IS NULL
RETURNING j.queue
), note AS (
    SELECT pg_notify(%(channel)s::text, q.queue) FROM (SELECT DISTINCT queue FROM released) AS q
    WHERE q.queue <> ALL(%(recent)s::text[])
)
SELECT r.queue FROM released AS r CROSS JOIN (SELECT count(*) FROM note) AS n

-- name: wf_end_blocked_many
-- Dependents that will not run: cancelled (a parent failed under policy cancel, or the
-- workflow was cancelled) or skipped (policy skip), each with its reason in its errors.
UPDATE {schema}.errands_jobs AS j
SET state = 'cancelled', finished_at = now(),
    errors = j.errors || jsonb_build_array(jsonb_build_object(
        'attempt', j.attempt, 'type', u.t, 'message', u.m,
        'traceback', NULL, 'worker', NULL, 'kind', u.k,
        'at', extract(epoch FROM now())))
FROM unnest(%(ids)s::bigint[], %(types)s::text[], %(kinds)s::text[], %(messages)s::text[])
     AS u(id, t, k, m)
WHERE j.id = u.id AND j.id = ANY(%(ids)s::bigint[]) AND j.state = 'waiting'
  AND j.wait_signal IS NULL
RETURNING j.id

-- name: wf_note_cancelled
-- Members that ended cancelled while their workflow's cancel was requested (the pending
-- ones its cancel ended; running ones it asked to stop, once they end): "the workflow was
-- cancelled" in their errors, as wf_end_blocked_many writes it for the dependents and
-- added members it cancels, once (those already saying so are left as they are).
UPDATE {schema}.errands_jobs AS j
SET errors = j.errors || jsonb_build_array(jsonb_build_object(
        'attempt', j.attempt, 'type', 'Cancelled', 'message', %(message)s::text,
        'traceback', NULL, 'worker', NULL, 'kind', 'cancelled',
        'at', extract(epoch FROM now())))
WHERE j.id = ANY(%(ids)s::bigint[]) AND j.state = 'cancelled'
  AND NOT j.errors @> jsonb_build_array(jsonb_build_object(
        'kind', 'cancelled', 'message', %(message)s::text))

-- name: wf_get_row
SELECT id, name, kind, state, total, completed, dead, cancelled, skipped, callbacks::text,
       on_success_job, on_settled_job, on_dead_job, cancel_requested,
       extract(epoch FROM created_at)::float8, extract(epoch FROM settled_at)::float8
FROM {schema}.errands_workflows WHERE id = %(id)s

-- name: wf_settle_row
-- The workflow's row (as wf_get_row), and whether a member is still pending.
SELECT w.id, w.name, w.kind, w.state, w.total, w.completed, w.dead, w.cancelled, w.skipped,
       w.callbacks::text, w.on_success_job, w.on_settled_job, w.on_dead_job,
       w.cancel_requested, extract(epoch FROM w.created_at)::float8,
       extract(epoch FROM w.settled_at)::float8,
       EXISTS (SELECT 1 FROM {schema}.errands_workflow_pending AS p WHERE p.workflow_id = w.id)
FROM {schema}.errands_workflows AS w WHERE w.id = %(id)s

-- name: wf_settle_fire
-- A workflow settles (in %(state)s; NULL: unchanged) and records the callback jobs just
-- inserted (NULL: none). Each callback column is set once, under the workflow's lock:
-- the callback's exactly-once guard. settled_at is when it last settled (%(settled)s:
-- nothing pending now): a workflow settled again after a replay counts its retention
-- from then, or it was pruned right away with the callbacks just fired reading it.
UPDATE {schema}.errands_workflows
SET state = COALESCE(%(state)s::text, state),
    settled_at = CASE WHEN %(settled)s THEN now() ELSE settled_at END,
    on_success_job = COALESCE(%(on_success)s::bigint, on_success_job),
    on_settled_job = COALESCE(%(on_settled)s::bigint, on_settled_job),
    on_dead_job = COALESCE(%(on_dead)s::bigint, on_dead_job)
WHERE id = %(id)s

-- name: wf_members_among
-- Which of the jobs given are workflow members (a bulk replay locks their workflows).
SELECT job_id FROM {schema}.errands_workflow_members WHERE job_id = ANY(%(ids)s::bigint[])

-- name: wf_dead_callbacks_among
-- Of the jobs given, the dead workflow callbacks, with the workflow and event each was
-- fired for (a replay refuses those whose workflow is gone: WorkflowStore
-- .orphaned_callbacks_among). Read as text: the caller parses the workflow id.
SELECT id, meta -> 'workflow_callback' ->> 'workflow', meta -> 'workflow_callback' ->> 'event'
FROM {schema}.errands_jobs
WHERE id = ANY(%(ids)s::bigint[]) AND state = 'dead'
  AND meta -> 'workflow_callback' IS NOT NULL

-- name: wf_existing
SELECT id FROM {schema}.errands_workflows WHERE id = ANY(%(ids)s::bigint[])

-- name: wf_cancelled_among
-- Of the jobs given, the members of a workflow whose cancel was requested, or of one
-- nested in such a workflow at any depth, each with the nearest such workflow: a replay
-- refuses them (a cancelled workflow's members do not run again). Read under the locks
-- the replay took (wf_lock_up), so a cancel requested before it is seen.
WITH RECURSIVE up(job_id, id, depth) AS (
    SELECT job_id, workflow_id, 0 FROM {schema}.errands_workflow_members
    WHERE job_id = ANY(%(ids)s::bigint[])
    UNION ALL
    SELECT up.job_id, m.workflow_id, up.depth + 1
    FROM up JOIN {schema}.errands_workflow_members AS m ON m.job_id = -up.id
)
SELECT DISTINCT ON (up.job_id) up.job_id, up.id
FROM up JOIN {schema}.errands_workflows AS w ON w.id = up.id
WHERE w.cancel_requested
ORDER BY up.job_id, up.depth

-- name: wf_reenter
-- Replayed dead members (job ids, or minus nested workflows' ids) are pending again (see
-- docs/workflows.md, "Replaying a member"): each one made pending, with its workflow.
INSERT INTO {schema}.errands_workflow_pending (job_id, workflow_id)
SELECT job_id, workflow_id FROM {schema}.errands_workflow_members
WHERE job_id = ANY(%(ids)s::bigint[]) AND outcome = 'dead'
ON CONFLICT DO NOTHING
RETURNING job_id, workflow_id

-- name: wf_reopen_edges
-- A replayed dead member's edges to dependents still waiting (for another parent) are
-- open again: they wait for its new end. Left decided ('dead'), a dependent was cancelled
-- (or went on, under run_anyway) when its last parent ended, whatever the replay gave.
-- A dependent already decided (released, cancelled, skipped) keeps its decision.
UPDATE {schema}.errands_workflow_edges AS e SET outcome = NULL
FROM {schema}.errands_jobs AS c
WHERE e.parent_id = ANY(%(ids)s::bigint[]) AND e.outcome = 'dead'
  AND c.id = e.child_id AND c.state = 'waiting' AND c.wait_signal IS NULL

-- name: wf_request_cancel
-- The workflow and every workflow nested in it, in one statement (cancelled one by one,
-- a nested one whose last member ended in between, adding members it saw cancelled by
-- its ancestor's flag, settled failed: its parent fired on_dead), locked in id order as
-- every other writer of several workflows locks them. Those not settled, and those
-- settled that a replay re-opened (a member pending again): their pending members end
-- cancelled by it, saying so, and they settle cancelled again. (A settled one with
-- nothing pending keeps its flag unset: a replay of one of its members is refused by
-- its ancestor's flag, wf_cancelled_among.)
WITH RECURSIVE tree(id) AS (
    SELECT %(id)s::bigint
    UNION
    SELECT -m.job_id FROM {schema}.errands_workflow_members AS m
    JOIN tree ON m.workflow_id = tree.id
    WHERE m.job_id < 0
), locked AS (
    SELECT w.id FROM {schema}.errands_workflows AS w
    WHERE w.id IN (SELECT id FROM tree)
      AND (w.settled_at IS NULL OR EXISTS (
          SELECT 1 FROM {schema}.errands_workflow_pending AS p WHERE p.workflow_id = w.id))
    ORDER BY w.id
    FOR UPDATE
)
UPDATE {schema}.errands_workflows AS w SET cancel_requested = true
FROM locked WHERE w.id = locked.id

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
-- A parent's state is its job's (its member outcome once the row was pruned, or for a
-- nested workflow), but 'skipped' for a skipped one: its job is stored cancelled, and the
-- dependents after it carry on as if it had completed, not as after a failed parent.
SELECT e.parent_id, m.node,
       CASE WHEN m.outcome = 'skipped' THEN m.outcome ELSE COALESCE(j.state, m.outcome) END,
       j.result::text, octet_length(j.result::text)
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
-- Settled before the retention, nested in no other, and nothing pending in it nor in a
-- workflow nested in it at any depth: a nested workflow goes with its outermost one
-- (wf_nested), whose result reads it until then. A member replayed since its workflow
-- settled is pending again (its settle time is the old one), and a nested workflow that
-- settled cancelled is not pending again in its parent: its pending rows are looked for.
-- Nor while a callback of one of them (on_success, on_settled, on_dead) has not ended, or
-- ended dead: it reads its workflow (ctx.workflow(), ctx.workflow_members()), and one
-- still waiting in a busy or paused queue, or between its retries, got JobNotFound once
-- the prune went past; so did a dead one replayed from the DLQ (dead jobs are kept until
-- replayed or discarded: the workflow is kept with them, and goes once it is discarded,
-- or replayed and ended otherwise than dead).
-- Oldest first: a batch bounded by the rows it deletes goes on from the oldest it left.
SELECT id FROM {schema}.errands_workflows AS w
WHERE settled_at IS NOT NULL AND settled_at < now() - make_interval(secs => %(older_than)s)
  AND (%(root)s::bigint IS NULL OR w.id = %(root)s::bigint)  -- one asked again, locked
  AND NOT EXISTS (SELECT 1 FROM {schema}.errands_workflow_members AS m WHERE m.job_id = -w.id)
  AND NOT EXISTS (
      WITH RECURSIVE tree(id) AS (
          SELECT w.id
          UNION
          SELECT -m.job_id FROM {schema}.errands_workflow_members AS m
          JOIN tree ON m.workflow_id = tree.id AND m.job_id < 0
      )
      SELECT 1 FROM {schema}.errands_workflow_pending AS p
      WHERE p.workflow_id IN (SELECT id FROM tree)
      UNION ALL
      SELECT 1 FROM tree
      JOIN {schema}.errands_workflows AS t ON t.id = tree.id
      JOIN {schema}.errands_jobs AS j
        ON j.id IN (t.on_success_job, t.on_settled_job, t.on_dead_job)
      WHERE j.state NOT IN ('completed', 'cancelled', 'discarded'))
ORDER BY settled_at
LIMIT %(limit)s

-- name: wf_nested
SELECT -job_id FROM {schema}.errands_workflow_members WHERE workflow_id = %(id)s AND job_id < 0

-- name: wf_tree_rows
-- The edge and member rows of these workflows (a prune's batch is bounded by the rows it
-- deletes), counted through the indexes that lead with workflow_id.
SELECT (SELECT count(*) FROM {schema}.errands_workflow_edges
        WHERE workflow_id = ANY(%(ids)s::bigint[]))
     + (SELECT count(*) FROM {schema}.errands_workflow_members
        WHERE workflow_id = ANY(%(ids)s::bigint[]))

-- name: wf_delete_edges
-- Through errands_workflow_edges_workflow (migration 20): without it, each workflow pruned
-- read every edge of every workflow kept.
DELETE FROM {schema}.errands_workflow_edges WHERE workflow_id = %(id)s

-- name: wf_delete_members
DELETE FROM {schema}.errands_workflow_members WHERE workflow_id = %(id)s

-- name: wf_delete_pending
DELETE FROM {schema}.errands_workflow_pending WHERE workflow_id = %(id)s

-- name: wf_delete
DELETE FROM {schema}.errands_workflows WHERE id = %(id)s

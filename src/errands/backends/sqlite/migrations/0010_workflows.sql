-- Version 10 (issue 18): workflows — batches, chains and DAGs with an exactly-once fan-in.
--
-- * errands_jobs.workflow_id: the workflow a job is a member of (NULL for every other
--   job, which is all the worker's finish path reads of it).
-- * errands_workflows: one row per batch or DAG: its callbacks (the job requests to insert
--   when it settles), the ids of the callback jobs once inserted (each set once: the
--   callback's exactly-once guard), and counts by outcome kept by each member's terminal
--   write (the O(1) status; never what decides the fan-in).
-- * errands_workflow_members: every member with its node name and outcome.
-- * errands_workflow_pending: the fan-in set, one row per member not yet terminal. A
--   member leaves it in the transaction of its own fenced terminal write; the transaction
--   that empties it settles the workflow.
-- * errands_workflow_edges: a DAG's edges, parent to dependent, each with its failure
--   policy and, once the parent ended, the parent's outcome. A dependent waits in state
--   'waiting' with no signal (out of every claim index) until its last edge resolves.

ALTER TABLE errands_jobs ADD COLUMN workflow_id INTEGER;

CREATE TABLE errands_workflows (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    name             TEXT    NOT NULL,
    kind             TEXT    NOT NULL CHECK (kind IN ('batch', 'dag')),
    state            TEXT    NOT NULL DEFAULT 'running'
                             CHECK (state IN ('running', 'succeeded', 'failed', 'cancelled')),
    total            INTEGER NOT NULL DEFAULT 0,
    completed        INTEGER NOT NULL DEFAULT 0,
    dead             INTEGER NOT NULL DEFAULT 0,
    cancelled        INTEGER NOT NULL DEFAULT 0,
    skipped          INTEGER NOT NULL DEFAULT 0,
    callbacks        TEXT    NOT NULL DEFAULT '{}',
    on_success_job   INTEGER,
    on_settled_job   INTEGER,
    on_dead_job      INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    created_at       REAL    NOT NULL,
    settled_at       REAL
);
CREATE INDEX errands_workflows_state ON errands_workflows (state, id);
-- Settled workflows the maintenance leader prunes past the retention period.
CREATE INDEX errands_workflows_settled ON errands_workflows (settled_at) WHERE settled_at IS NOT NULL;

CREATE TABLE errands_workflow_members (
    job_id      INTEGER PRIMARY KEY,
    workflow_id INTEGER NOT NULL,
    node        TEXT    NOT NULL,
    outcome     TEXT
);
CREATE INDEX errands_workflow_members_workflow ON errands_workflow_members (workflow_id, job_id);

CREATE TABLE errands_workflow_pending (
    job_id      INTEGER PRIMARY KEY,
    workflow_id INTEGER NOT NULL
);
CREATE INDEX errands_workflow_pending_workflow ON errands_workflow_pending (workflow_id);

CREATE TABLE errands_workflow_edges (
    parent_id   INTEGER NOT NULL,
    child_id    INTEGER NOT NULL,
    workflow_id INTEGER NOT NULL,
    policy      TEXT    NOT NULL CHECK (policy IN ('cancel', 'run_anyway', 'skip')),
    outcome     TEXT,
    PRIMARY KEY (parent_id, child_id)
);
CREATE INDEX errands_workflow_edges_child ON errands_workflow_edges (child_id, parent_id);

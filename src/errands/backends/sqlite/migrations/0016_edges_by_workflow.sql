-- Version 16: a workflow's edges found by its id. The prune deletes a settled workflow's
-- edges by workflow_id (wf_delete_edges), which no index led with: each workflow pruned
-- read every edge of every workflow kept, under the write lock. With 500,000 edges of
-- live DAGs, one batch of 1,000 small settled workflows held it 24 s, every enqueue and
-- finish waiting (tests/unit/test_sqlite_prune_plan.py). Building the index holds the
-- write lock while it reads the table once (a fraction of a second per million edges).
CREATE INDEX errands_workflow_edges_workflow ON errands_workflow_edges (workflow_id);

-- Version 20: a workflow's edges found by its id. The prune deletes a settled workflow's
-- edges by workflow_id (wf_delete_edges), which no index led with: each workflow pruned
-- read every edge of every workflow kept, in the prune's transaction. With 500,000 edges
-- of live DAGs, one batch of 1,000 small settled workflows took 34 s, its locks held all
-- along (tests/postgres/test_workflow_prune_plans.py).
--
-- CREATE INDEX takes a SHARE lock on errands_workflow_edges until the migration commits:
-- inserting a DAG and the end of a DAG's member (which records its outcome on its edges)
-- wait meanwhile; claims, the ends of plain jobs and reads do not. It reads the table
-- once: about 0.3 s per million edges on a table in cache. The lock is asked for within
-- 5 s (a long transaction holding the table makes the migration fail, changing nothing:
-- run it again). On a large live table, build the index first with
-- CREATE INDEX CONCURRENTLY under the same name (no lock that stops writes): this
-- statement then skips it. An index of that name left invalid by a failed
-- CREATE INDEX CONCURRENTLY is built again.
SET LOCAL lock_timeout = '5s';
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index
               WHERE indexrelid = to_regclass('{schema}.errands_workflow_edges_workflow')
                 AND NOT indisvalid) THEN
        DROP INDEX {schema}.errands_workflow_edges_workflow;
    END IF;
END
$$;

CREATE INDEX IF NOT EXISTS errands_workflow_edges_workflow
    ON {schema}.errands_workflow_edges (workflow_id);

-- Version 13 (issue 18): a dependent's parents that have not ended, found without reading
-- its ended ones. Each member's end asked whether its dependents still wait by reading
-- every edge into them: at the fan-in of 1 -> 10,000 -> 1 each of the 10,000 ends read the
-- final node's 10,000 edges (10^8 row reads, 84 members/s). The fan-in now asks for one
-- open edge through this index (the edges that still wait, which shrinks as parents end)
-- and reads a dependent's edges once, when none is left.
CREATE INDEX errands_workflow_edges_open
    ON errands_workflow_edges (child_id) WHERE outcome IS NULL;

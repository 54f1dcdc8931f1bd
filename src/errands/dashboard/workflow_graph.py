"""A workflow drawn as a graph for the dashboard: members in columns by depth (a node sits
one column right of its deepest parent), edges from parent to dependent, each node
coloured by its state. Pure layout: coordinates for the template's SVG."""

from __future__ import annotations

from dataclasses import dataclass

from ..workflows import Member

NODE_WIDTH = 170
NODE_HEIGHT = 34
COLUMN_GAP = 60
ROW_GAP = 14
MARGIN = 10
GRAPH_MAX_NODES = 300  # wider workflows are shown as the table only


@dataclass(frozen=True)
class GraphNode:
    job_id: int
    node: str
    state: str  # the member's outcome once it ended, else its job's state
    x: int
    y: int


@dataclass(frozen=True)
class GraphEdge:
    x1: int
    y1: int
    x2: int
    y2: int
    failed: bool  # the parent died or was cancelled


@dataclass(frozen=True)
class Graph:
    nodes: list[GraphNode]
    edges: list[GraphEdge]
    width: int
    height: int
    node_width: int = NODE_WIDTH
    node_height: int = NODE_HEIGHT


def layout(members: list[Member]) -> Graph | None:
    """The graph of ``members`` (None when there are too many to draw)."""
    if not members or len(members) > GRAPH_MAX_NODES:
        return None
    by_id = {m.job_id: m for m in members}
    depth: dict[int, int] = {}
    for member in sorted(members, key=lambda m: m.job_id):  # parents have lower ids
        parents = [p for p in member.parents if p in by_id]
        depth[member.job_id] = 1 + max((depth.get(p, 0) for p in parents), default=-1)
    columns: dict[int, list[Member]] = {}
    for member in sorted(members, key=lambda m: m.job_id):
        columns.setdefault(depth[member.job_id], []).append(member)
    place: dict[int, tuple[int, int]] = {}
    nodes = []
    for column, in_column in sorted(columns.items()):
        for row, member in enumerate(in_column):
            x = MARGIN + column * (NODE_WIDTH + COLUMN_GAP)
            y = MARGIN + row * (NODE_HEIGHT + ROW_GAP)
            place[member.job_id] = (x, y)
            state = member.outcome or member.state or "pruned"
            nodes.append(GraphNode(member.job_id, member.node, state, x, y))
    edges = [
        GraphEdge(
            place[p][0] + NODE_WIDTH,
            place[p][1] + NODE_HEIGHT // 2,
            place[m.job_id][0],
            place[m.job_id][1] + NODE_HEIGHT // 2,
            by_id[p].outcome in ("dead", "cancelled"),
        )
        for m in members
        for p in m.parents
        if p in place
    ]
    width = MARGIN * 2 + len(columns) * (NODE_WIDTH + COLUMN_GAP) - COLUMN_GAP
    tallest = max(len(c) for c in columns.values())
    height = MARGIN * 2 + tallest * (NODE_HEIGHT + ROW_GAP) - ROW_GAP
    return Graph(nodes, edges, width, height)

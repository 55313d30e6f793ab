"""Fair share along the department tree, at the cost of the path a placement changes.

The order is the flat one's (priority class, then standing, then age, then id) with the
standing read level by level from the top (scheduler/departments.py): within a priority
class, sibling units go by their own standing, and a unit's best request stands for it
against its siblings. So each class keeps, at every node of the tree, a heap of its
children keyed ``(standing, 0, (age, id))`` for a project (its oldest waiting request) and
``(standing, 1, best key below)`` for a department: on equal standings a project goes before
a department, as a shorter tuple of standings sorts first in the flat order. A placement
changes the standings on its project's path only, so only those nodes are keyed again (old
entries are dropped lazily, by version): a cycle that places thousands under one department
costs a few heap operations per level, not a re-sort of every project under it.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Callable, Iterable

from scheduler.cluster import Request
from scheduler.departments import OrgTree

Key = tuple[object, ...]
ROOT = ""


class ClassTree:
    """One priority class's waiting requests, in the fair tree's order."""

    def __init__(self, tree: OrgTree, standing: Callable[[str], float]) -> None:
        self._tree = tree
        self._standing = standing
        self._waiting: dict[str, deque[Request]] = {}  # project -> its requests, oldest first
        self._heaps: dict[str, list[tuple[Key, int, str]]] = defaultdict(list)  # parent -> children
        self._version: dict[str, int] = defaultdict(int)  # a child's current entry in its parent

    def add(self, project: str, requests: Iterable[Request]) -> None:
        self._waiting[project] = deque(sorted(requests, key=lambda r: (r.submitted_at, r.id)))
        self.refresh(project)

    def next(self) -> Request | None:
        """The best request of the class, taken off its project's queue; None when none
        waits. Its project's path is keyed again now (its next request), and again once the
        placement is charged (``FairOrder.settle``)."""
        node = ROOT
        while True:
            entry = self._top(node)
            if entry is None:
                return None
            node = entry[2]
            if node.startswith("p:"):
                request = self._waiting[node[2:]].popleft()
                self.refresh(node[2:])
                return request

    def refresh(self, project: str) -> None:
        """Key again each node of the project's path in its parent's heap, lowest first (a
        department's key reads its best child's)."""
        path = self._tree.path(project)
        for depth, node in enumerate(path):
            self._version[node] += 1
            key = self._key(node)
            if key is not None:
                parent = path[depth + 1] if depth + 1 < len(path) else ROOT
                heapq.heappush(self._heaps[parent], (key, self._version[node], node))

    def _key(self, node: str) -> Key | None:
        if node.startswith("p:"):
            waiting = self._waiting.get(node[2:])
            if not waiting:
                return None
            head = waiting[0]
            return (self._standing(node), 0, (head.submitted_at, head.id))
        best = self._top(node)
        return None if best is None else (self._standing(node), 1, best[0])

    def _top(self, parent: str) -> tuple[Key, int, str] | None:
        heap = self._heaps.get(parent)
        while heap and heap[0][1] != self._version[heap[0][2]]:
            heapq.heappop(heap)  # keyed again since: a stale entry
        return heap[0] if heap else None

"""Departments: the tree of organisational units above projects (institute -> group -> project).

Each level may have a guarantee and a ceiling, in milli-GPU held at once by all the projects
below it, as Run:ai's departments, KAI's parent queues and Kueue's cohorts do:

* **Ceiling.** Nothing starts that would take any level over its limit.
* **Guarantee and borrowing.** A level holds its guarantee as of right; what it holds above
  it is borrowed idle capacity. A placement is *borrowed* when it takes any level on its
  project's path over that level's guarantee. A department with no guarantee of its own
  guarantees what its children do together (none at all when none of them has one).
* **Reclaim.** A request may take back borrowed capacity from another project by preemption
  where the two first meet in the tree: below their lowest common department, the
  requester's side must be within its guarantee (this request included) and the victim's
  side over its own, and the reclaim takes that side down towards its guarantee, never
  below. So siblings in a group reclaim from each other down to each one's guarantee,
  while another institute may take back only what the whole group borrowed beyond the
  group's guarantee. Flat projects (no department) meet at the root: each is its own side.

Nodes are named ``p:<project>`` and ``d:<department>``. The tree is read from
``FairShareState``; a loop in the parents (which the portal refuses) is cut where it closes.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache

from scheduler.cluster import FairShareState, ProjectShare

_NO_SHARE = ProjectShare()


def project_node(project: str) -> str:
    return f"p:{project}"


def node_label(node: str) -> str:
    """How a reason names a node: "project vision", "department physics"."""
    kind, _, name = node.partition(":")
    return f"{'project' if kind == 'p' else 'department'} {name}"


class OrgTree:
    """Each project's path to the root, and each node's guarantee, ceiling and weight."""

    def __init__(self, state: FairShareState | None) -> None:
        self._projects = state.projects if state is not None else {}
        self._departments = state.departments if state is not None else {}
        self.path = cache(self._path)
        self.guaranteed = cache(self._guaranteed)
        self._children: dict[str, list[str]] = defaultdict(list)
        for name, share in self._projects.items():
            if share.department is not None:
                self._children[f"d:{share.department}"].append(project_node(name))
        for name, department in self._departments.items():
            if department.parent is not None:
                self._children[f"d:{department.parent}"].append(f"d:{name}")

    @property
    def flat(self) -> bool:
        return not self._departments

    def _path(self, project: str) -> tuple[str, ...]:
        """``p:<project>``, then each department above it, the top one last."""
        path = [project_node(project)]
        department = self._projects.get(project, _NO_SHARE).department
        while department is not None and f"d:{department}" not in path and department in self._departments:
            path.append(f"d:{department}")
            department = self._departments[department].parent
        return tuple(path)

    def limit(self, node: str) -> int | None:
        kind, _, name = node.partition(":")
        if kind == "p":
            return self._projects.get(name, _NO_SHARE).limit_milli
        department = self._departments.get(name)
        return department.limit_milli if department is not None else None

    def weight(self, node: str) -> float:
        kind, _, name = node.partition(":")
        if kind == "p":
            return self._projects.get(name, _NO_SHARE).weight
        department = self._departments.get(name)
        return department.weight if department is not None else 1.0

    def _guaranteed(self, node: str, seen: frozenset[str] = frozenset()) -> int | None:
        kind, _, name = node.partition(":")
        if kind == "p":
            return self._projects.get(name, _NO_SHARE).guaranteed_milli
        department = self._departments.get(name)
        if department is not None and department.guaranteed_milli is not None:
            return department.guaranteed_milli
        children = [child for child in self._children.get(node, ()) if child not in seen]
        below = [self._guaranteed(child, seen | {node}) for child in children]
        known = [g for g in below if g is not None]
        return sum(known) if known else None

    def sides(self, project: str, other: str) -> tuple[str, str] | None:
        """The two nodes just below where ``project`` and ``other`` meet: (project's side,
        other's side); None for one project."""
        mine, theirs = list(self.path(project)), list(self.path(other))
        while mine and theirs and mine[-1] == theirs[-1]:
            mine.pop()
            theirs.pop()
        if not mine or not theirs:
            return None
        return mine[-1], theirs[-1]

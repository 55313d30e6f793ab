"""Quotas per GPU model: a project's cap on what it holds of some models at once.

A limit names one model ("H100-80GB") or a class of models an admin defines ("Hopper":
H100-80GB and H200), and caps the milli-GPU the project holds on them, as Kueue's resource
flavors cap each flavor. A limit may also be closed outright (``closed``: its GPU-hours for
the month are used up), which the portal decides from the ledger.

Admission narrows a request to the models it may still take: a request for "any" model,
with the project at its H100 limit, may still start on an A100, and is placed as one that
asked for the A100 only; one that named the H100 waits, and says which limit holds it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from scheduler.cluster import DeviceGrant, FairShareState, ModelLimit, Request, Running
from scheduler.departments import OrgTree, node_label, project_node


@dataclass(frozen=True)
class Narrowed:
    """A request as its model limits let it be placed; ``refusal`` when none does. ``kept_off``
    says which models it accepted were left out and why, for a reason if it then waits."""

    request: Request
    refusal: str = ""
    kept_off: str = ""


class ModelQuotas:
    """Milli-GPU each project holds per model limit this cycle."""

    def __init__(
        self, state: FairShareState | None, running: list[Running], model_of: Callable[[str], str]
    ) -> None:
        # By node of the tree (scheduler/departments.py): a department's limits bind what all
        # of its projects hold together, as a project's bind the project.
        self._tree = OrgTree(state)
        self._limits: dict[str, tuple[ModelLimit, ...]] = {}
        if state is not None:
            for project, share in state.projects.items():
                if share.model_limits:
                    self._limits[project_node(project)] = share.model_limits
            for name, department in state.departments.items():
                if department.model_limits:
                    self._limits[f"d:{name}"] = department.model_limits
        self._model_of = model_of
        self.used: dict[tuple[str, str], int] = defaultdict(int)
        for alloc in running:
            self.add(alloc.project, alloc.grants)

    def __bool__(self) -> bool:
        return bool(self._limits)

    def narrow(self, request: Request, milli: int, fleet_models: Callable[[], Iterable[str]]) -> Narrowed:
        """``request`` with the models whose limits have no room for ``milli`` more left out
        of what it accepts (all of the fleet's, if it accepts any), or a refusal naming the
        limits when none is left."""
        limits = self._path_limits(request.project)
        if not limits:
            return Narrowed(request)
        held: dict[str, str] = {}  # model -> the first limit that holds it back
        for node, limit in limits:
            why = limit.closed or self._over(node, limit, milli)
            if why:
                for model in limit.models:
                    held.setdefault(model, why)
        if not held:
            return Narrowed(request)
        accepted = request.gpu_models or tuple(sorted(fleet_models()))
        allowed = tuple(m for m in accepted if m not in held)
        if not allowed:
            reasons = dict.fromkeys(held[m] for m in accepted)  # each once, in the models' order
            return Narrowed(request, "; ".join(reasons) or "quota: no GPU model left within the limits")
        if allowed == accepted:
            return Narrowed(request)
        left_out = [m for m in accepted if m in held]
        reasons = dict.fromkeys(held[m] for m in left_out)
        note = f"not on {', '.join(left_out)}: " + "; ".join(reasons)
        return Narrowed(replace(request, gpu_models=allowed), kept_off=note)

    def _path_limits(self, project: str) -> list[tuple[str, ModelLimit]]:
        """The limits on the project's path: its own first, then each department's above it."""
        if not self._limits:
            return []
        return [(node, limit) for node in self._tree.path(project) for limit in self._limits.get(node, ())]

    def _over(self, node: str, limit: ModelLimit, milli: int) -> str:
        used = self.used[(node, limit.name)]
        if limit.limit_milli is None or used + milli <= limit.limit_milli:
            return ""
        return (
            f"quota: {node_label(node)} holds {used / 1000:g} of its {limit.limit_milli / 1000:g} "
            f"{limit.name} GPU limit and this needs {milli / 1000:g} more"
        )

    def add(self, project: str, grants: Iterable[DeviceGrant], sign: int = 1) -> None:
        for node, limit in self._path_limits(project):
            for grant in grants:
                if self._model_of(grant.gpu_uuid) in limit.models:
                    self.used[(node, limit.name)] += sign * grant.milli_gpu

    def remove(self, project: str, grants: Iterable[DeviceGrant]) -> None:
        self.add(project, grants, sign=-1)

"""The department tree as the portal reads it: which units lie below one and which projects
are in them (the quotas per model, the project page). The scheduler's own view of the tree is
scheduler/departments.py."""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal

from portal.quotas.models import Department, QuotaPolicy


def below(department: Department) -> list[Department]:
    """The department and every unit under it (one query: the table is an org chart, small)."""
    children: dict[int | None, list[Department]] = defaultdict(list)
    for unit in Department.objects.all():
        children[unit.parent_id].append(unit)
    found: list[Department] = []
    todo = [department]
    while todo:
        unit = todo.pop()
        if unit.pk in {f.pk for f in found}:
            continue  # a loop the console refused, made some other way: cut
        found.append(unit)
        todo.extend(children.get(unit.pk, ()))
    return found


def project_ids_below(department: Department) -> list[int]:
    """The projects whose quota sits in the department or any unit under it."""
    units = [unit.pk for unit in below(department)]
    return list(QuotaPolicy.objects.filter(department__in=units).values_list("project_id", flat=True))


def tree_figures(departments: list[Department]) -> dict[int, tuple[int, Decimal | None]]:
    """Per department: the projects anywhere under it, and the guarantee it gives (its own,
    or its parts' summed, as the scheduler counts it: None when nothing under it has one).
    Two queries, whatever the depth."""
    children: dict[int | None, list[Department]] = defaultdict(list)
    for unit in departments:
        children[unit.parent_id].append(unit)
    quotas: dict[int, list[Decimal]] = defaultdict(list)
    for department_id, guaranteed in QuotaPolicy.objects.filter(department__isnull=False).values_list(
        "department_id", "guaranteed_gpus"
    ):
        quotas[department_id].append(guaranteed)
    found: dict[int, tuple[int, Decimal | None]] = {}

    def visit(unit: Department, seen: frozenset[int]) -> tuple[int, Decimal | None]:
        if unit.pk in found:
            return found[unit.pk]
        parts = [
            visit(child, seen | {unit.pk}) for child in children.get(unit.pk, ()) if child.pk not in seen
        ]
        projects = len(quotas[unit.pk]) + sum(n for n, _ in parts)
        given = [g for g in quotas[unit.pk] if g] + [g for _, g in parts if g is not None]
        guaranteed = (
            unit.guaranteed_gpus
            if unit.guaranteed_gpus is not None
            else (sum(given, Decimal(0)) if given else None)
        )
        found[unit.pk] = (projects, guaranteed)
        return found[unit.pk]

    for unit in departments:
        visit(unit, frozenset())
    return found


def promised_within(
    parent: Department, *, but_department: int | None = None, but_quota: int | None = None
) -> Decimal:
    """What the parts of ``parent`` guarantee together (its child units, as the scheduler
    counts each, and its projects), leaving out the one being edited."""
    units = list(Department.objects.all())
    given = tree_figures(units)
    children = sum(
        (given[u.pk][1] or Decimal(0) for u in units if u.parent_id == parent.pk and u.pk != but_department),
        Decimal(0),
    )
    quotas = QuotaPolicy.objects.filter(department=parent)
    if but_quota is not None:
        quotas = quotas.exclude(pk=but_quota)
    projects = quotas.values_list("guaranteed_gpus", flat=True)
    return children + sum(projects, Decimal(0))


def department_paths() -> dict[int, str]:
    """Every department's path from the top, "Science / Physics", by id (one query)."""
    units = {u.pk: u for u in Department.objects.all()}
    paths: dict[int, str] = {}
    for pk, unit in units.items():
        names: list[str] = []
        seen: set[int] = set()
        here: Department | None = unit
        while here is not None and here.pk not in seen:
            seen.add(here.pk)
            names.append(here.name)
            here = units.get(here.parent_id) if here.parent_id is not None else None
        paths[pk] = " / ".join(reversed(names))
    return paths

"""Defragmentation plans: MIG re-layouts and shared-GPU consolidation.

Two planners, pure functions from a picture of the fleet to a list of moves a host agent
can execute. Neither touches anything; ``apply_mig_plan`` and ``apply_share_plan`` replay a
plan on that picture, which is how the tests and the benchmark check them.

MIG (``plan_mig``). A request for a profile that has no legal free start anywhere may still
fit if some instances move. Idle instances (no sandbox) cost nothing to destroy; a busy one
is *disturbed* when its sandbox has to stop and start elsewhere, on the same GPU at another
start or on another GPU of the same model. The planner finds, per GPU and per start of the
requested profile, the smallest set of busy instances to move (exact: every subset, by
size, of the at most 7 instances of one GPU), re-packs them on that GPU where they fit and
sends the rest to other GPUs (greedily, fullest GPU first, never disturbing anything
there). Across GPUs it takes the plan with the fewest disturbed sandboxes, then the fewest
migrations off the GPU, then the fewest moves, then fleet order: deterministic.

Order of execution of ``MigPlan.moves`` (the list is already in this order):

1. ``destroy`` of idle instances in the way, on the target GPU and on migration targets;
2. ``migrate``: create the instance on ``to_gpu`` at ``to_start``, move the sandbox there,
   then destroy the source (make before break: the sandbox keeps its slot until the new
   one exists, and the destination is free after step 1);
3. ``destroy`` of the busy instances that move within the target GPU (their sandboxes are
   checkpointed or stopped first);
4. ``create`` of those instances at their new starts, restarting their sandboxes.

Every intermediate layout is legal: step 2 only adds where step 1 freed room, step 3 only
removes, and step 4 builds the final layout, which is legal, from a subset of it.

Shares (``plan_consolidation``). GPUs shared by milli-GPU or MPS shares are emptied from the
emptiest up: all shares of a GPU move, best fit, onto other GPUs already in use that have
room (milli-GPU, memory, allowed models), or none does. Emptiest first frees a GPU for the
fewest migrations. Migrations run one at a time, each starting the sandbox on the
destination before stopping it on the source; destinations only gain and sources only lose
shares, so no GPU is over capacity at any step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from itertools import combinations
from typing import Any

from scheduler.gpus import CATALOG, COMPUTE_SLICES, GpuModel, MigProfile, check_layout

DESTROY, CREATE, MIGRATE = "destroy", "create", "migrate"


@dataclass(frozen=True)
class MigInstance:
    uuid: str
    profile: str
    start: int
    sandbox: str = ""  # the sandbox running in it; "" when idle

    @property
    def busy(self) -> bool:
        return bool(self.sandbox)


@dataclass(frozen=True)
class MigGpu:
    uuid: str
    model: str  # a key of scheduler.gpus.CATALOG
    instances: tuple[MigInstance, ...] = ()
    available: bool = True  # False when drained: it takes no new instance

    def layout(self) -> list[tuple[str, int]]:
        return [(i.profile, i.start) for i in self.instances]


@dataclass(frozen=True)
class MigMove:
    """One step of a plan; see the module docstring for the order they run in.

    ``destroy`` and ``create`` act on ``gpu`` at ``start``; ``migrate`` takes the sandbox
    in ``instance`` (on ``gpu`` at ``start``) to a new instance on ``to_gpu`` at ``to_start``.
    """

    kind: str  # DESTROY | CREATE | MIGRATE
    gpu: str
    profile: str
    start: int
    instance: str = ""  # the existing instance acted on; "" for a create
    sandbox: str = ""  # the sandbox moved or restarted; "" for an idle instance
    to_gpu: str = ""
    to_start: int = -1


@dataclass(frozen=True)
class MigPlan:
    profile: str  # the requested profile, which fits at (gpu, start) once the moves ran
    gpu: str
    start: int
    moves: tuple[MigMove, ...]
    disturbed: tuple[str, ...]  # sandboxes the plan stops and starts again

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MigPlan:
        return cls(
            profile=data["profile"],
            gpu=data["gpu"],
            start=int(data["start"]),
            moves=tuple(MigMove(**move) for move in data["moves"]),
            disturbed=tuple(data["disturbed"]),
        )


# -- MIG planning ----------------------------------------------------------------------------


@dataclass
class _Room:
    """What the busy instances of one GPU take, plus what a plan has added there so far."""

    gpu: MigGpu
    model: GpuModel
    index: int
    mask: int = 0
    compute: int = 0
    media: int = 0
    busy: list[MigInstance] = field(default_factory=list)
    idle: list[MigInstance] = field(default_factory=list)

    def fits(self, profile: MigProfile, start: int) -> bool:
        return (
            not self.mask & profile.mask(start)
            and self.compute + profile.compute_slices <= COMPUTE_SLICES
            and not (profile.media_extension and self.media)
        )

    def add(self, profile: MigProfile, start: int, sign: int = 1) -> None:
        self.mask ^= profile.mask(start)
        self.compute += sign * profile.compute_slices
        self.media += sign * profile.media_extension


def _room(gpu: MigGpu, index: int) -> _Room:
    model = CATALOG[gpu.model]
    room = _Room(gpu, model, index)
    for inst in sorted(gpu.instances, key=lambda i: i.start):
        if inst.busy:
            room.busy.append(inst)
            room.add(model.profile(inst.profile), inst.start)
        else:
            room.idle.append(inst)
    return room


@cache
def _largest_first(model: GpuModel) -> tuple[MigProfile, ...]:
    return tuple(sorted(model.mig_profiles, key=lambda p: (-p.memory_slices, -p.compute_slices)))


def _pick_start(room: _Room, profile: MigProfile) -> int | None:
    """The legal start that leaves the most room for large profiles, or None.

    Score: for each profile, largest first, how many starts stay free; compared in that
    order, so a 1g lands where it blocks no 3g/4g start if there is such a place.
    """
    best: tuple[tuple[int, ...], int] | None = None
    ranked = _largest_first(room.model)
    for start in profile.starts:
        if not room.fits(profile, start):
            continue
        room.add(profile, start)
        score = tuple(sum(room.fits(p, s) for s in p.starts) for p in ranked)
        room.add(profile, start, -1)
        if best is None or score > best[0]:
            best = (score, start)
    return None if best is None else best[1]


def _clear_idle(
    room: _Room, busy: Sequence[MigInstance], added: Sequence[tuple[MigProfile, int]]
) -> list[MigMove]:
    """Destroy moves for the idle instances of ``room`` that ``busy`` plus ``added`` need gone."""
    layout = [(i.profile, i.start) for i in busy] + [(p.name, s) for p, s in added]
    doomed = []
    for inst in room.idle:
        if check_layout(room.model, [*layout, (inst.profile, inst.start)]):
            doomed.append(MigMove(DESTROY, room.gpu.uuid, inst.profile, inst.start, instance=inst.uuid))
        else:
            layout.append((inst.profile, inst.start))
    return doomed


def _conflicts(room: _Room, profile: MigProfile, start: int) -> list[MigInstance]:
    """Busy instances of ``room`` that must leave for ``profile`` to take ``start``."""
    return [
        i
        for i in room.busy
        if room.model.profile(i.profile).mask(i.start) & profile.mask(start)
        or (profile.media_extension and room.model.profile(i.profile).media_extension)
    ]


@dataclass
class _Candidate:
    moves: list[MigMove]
    disturbed: list[str]
    outs: int

    def key(self) -> tuple[int, int, int]:
        return len(self.disturbed), self.outs, len(self.moves)


class _Search:
    """One planning call: the fleet as rooms, and the search for one (GPU, start)."""

    def __init__(self, fleet: Sequence[MigGpu]) -> None:
        self.rooms = [_room(g, i) for i, g in enumerate(fleet) if CATALOG[g.model].mig_capable]
        # Migration targets, fullest first: filling busy GPUs keeps empty ones whole.
        self.targets = sorted(
            (r for r in self.rooms if r.gpu.available), key=lambda r: (-r.compute, -len(r.busy), r.index)
        )
        self.open: dict[tuple[str, str], list[_Room]] = {}

    def _open_rooms(self, model: GpuModel, profile: MigProfile) -> None:
        """List the targets with a start for ``profile``; call it with no search under way.

        Rooms other than the home one only fill up during a search, so a room with no start
        for ``profile`` before it never gets one: ``_send_out`` looks at the listed ones only.
        """
        key = (model.name, profile.name)
        if key not in self.open:
            self.open[key] = [
                r for r in self.targets if r.model is model and _pick_start(r, profile) is not None
            ]

    def _send_out(self, home: _Room, profile: MigProfile) -> tuple[_Room, int] | None:
        for room in self.open[home.model.name, profile.name]:
            if room is not home:
                start = _pick_start(room, profile)
                if start is not None:
                    return room, start
        return None

    def solve(self, home: _Room, profile: MigProfile, start: int, extras: int) -> _Candidate | None:
        """Fewest-migration plan that puts ``profile`` at ``start`` moving conflicts + ``extras``."""
        conflicts = _conflicts(home, profile, start)
        others = [i for i in home.busy if i not in conflicts]
        for inst in home.busy:
            self._open_rooms(home.model, home.model.profile(inst.profile))
        best: _Candidate | None = None
        for chosen in combinations(others, extras):
            movers = sorted(
                [*conflicts, *chosen],
                key=lambda i: (-home.model.profile(i.profile).memory_slices, i.start),
            )
            for inst in movers:
                home.add(home.model.profile(inst.profile), inst.start, -1)
            if home.fits(profile, start):
                home.add(profile, start)
                found = self._repack(home, movers, [], best.outs if best else len(movers) + 1)
                home.add(profile, start, -1)
                if found is not None:
                    candidate = self._candidate(home, profile, start, found)
                    if best is None or candidate.key() < best.key():
                        best = candidate
            for inst in movers:
                home.add(home.model.profile(inst.profile), inst.start)
            if best is not None and best.outs == 0:
                break
        return best

    def _repack(
        self,
        home: _Room,
        movers: list[MigInstance],
        done: list[tuple[MigInstance, _Room, int]],
        bound: int,
    ) -> list[tuple[MigInstance, _Room, int]] | None:
        """Place ``movers`` on ``home`` or elsewhere with fewer than ``bound`` migrations.

        Depth first, home starts before migration, so the first complete answer found at
        each bound is the one with the fewest migrations; rooms are updated in place and
        restored on the way back.
        """
        outs = sum(room is not home for _, room, _ in done)
        if outs >= bound:
            return None
        if not movers:
            return list(done)
        inst, rest = movers[0], movers[1:]
        profile = home.model.profile(inst.profile)
        best: list[tuple[MigInstance, _Room, int]] | None = None
        options: list[tuple[_Room, int]] = [(home, s) for s in profile.starts if home.fits(profile, s)]
        away = self._send_out(home, profile)
        if away is not None:
            options.append(away)
        for room, start in options:
            room.add(profile, start)
            done.append((inst, room, start))
            found = self._repack(home, rest, done, bound)
            done.pop()
            room.add(profile, start, -1)
            if found is not None:
                best, bound = found, sum(r is not home for _, r, _ in found)
                if bound == outs:
                    break
        return best

    def _candidate(
        self, home: _Room, profile: MigProfile, start: int, placed: list[tuple[MigInstance, _Room, int]]
    ) -> _Candidate:
        model = home.model
        moved = {i for i, _, _ in placed}
        staying = [(model.profile(i.profile), s) for i, r, s in placed if r is home]
        kept = [i for i in home.busy if i not in moved]
        moves = _clear_idle(home, kept, [(profile, start), *staying])
        away: dict[int, list[tuple[MigProfile, int]]] = {}
        for inst, room, s in placed:
            if room is not home:
                away.setdefault(room.index, []).append((model.profile(inst.profile), s))
        for room in self.rooms:
            if room.index in away:
                moves += _clear_idle(room, room.busy, away[room.index])
        moves += [
            MigMove(MIGRATE, home.gpu.uuid, i.profile, i.start, i.uuid, i.sandbox, r.gpu.uuid, s)
            for i, r, s in placed
            if r is not home
        ]
        local = [(i, s) for i, r, s in placed if r is home]
        moves += [MigMove(DESTROY, home.gpu.uuid, i.profile, i.start, i.uuid, i.sandbox) for i, _ in local]
        moves += [MigMove(CREATE, home.gpu.uuid, i.profile, s, sandbox=i.sandbox) for i, s in local]
        return _Candidate(moves, [i.sandbox for i, _, _ in placed], len(placed) - len(local))


def place_mig(fleet: Sequence[MigGpu], profile: str) -> tuple[str, int] | None:
    """Where a new ``profile`` instance goes with no re-layout: (GPU uuid, start) or None.

    The fullest GPU that has a legal free start (idle instances count as taken: they are
    someone's pre-made slices), at the start that blocks the fewest large profiles.
    """
    search = _Search(fleet)
    for room in search.targets:
        if any(p.name == profile for p in room.model.mig_profiles):
            for inst in room.idle:
                room.add(room.model.profile(inst.profile), inst.start)
            start = _pick_start(room, room.model.profile(profile))
            if start is not None:
                return room.gpu.uuid, start
    return None


def plan_mig(fleet: Sequence[MigGpu], profile: str, max_disturbed: int = COMPUTE_SLICES) -> MigPlan | None:
    """The re-layout that disturbs the fewest busy instances so that ``profile`` fits.

    None when no plan within ``max_disturbed`` sandboxes exists. When ``profile`` already
    fits (after destroying idle instances at most) the plan disturbs nothing.
    """
    search = _Search(fleet)
    homes = [
        r for r in search.rooms if r.gpu.available and any(p.name == profile for p in r.model.mig_profiles)
    ]
    # Lower bound per (GPU, start): the busy instances in the way must move.
    bounds: list[tuple[int, int, int, _Room]] = []
    for room in homes:
        wanted = room.model.profile(profile)
        for start in wanted.starts:
            bounds.append((len(_conflicts(room, wanted, start)), room.index, start, room))
    bounds.sort(key=lambda b: b[:3])
    # Iterative deepening on the number disturbed, so no (GPU, start) is searched deeper
    # than the cheapest plan anywhere needs.
    for level in range(max_disturbed + 1):
        best: tuple[_Candidate, _Room, int] | None = None
        for overlap, _, start, room in bounds:
            if overlap > level:
                break  # sorted: no later (GPU, start) fits at this level either
            found = search.solve(room, room.model.profile(profile), start, level - overlap)
            if found is not None and (best is None or found.key() < best[0].key()):
                best = (found, room, start)
                if found.outs == 0 and len(found.moves) == 2 * level:
                    break  # nothing at this level can beat it: no idle to destroy, no migration
        if best is not None:
            found, room, start = best
            return MigPlan(profile, room.gpu.uuid, start, tuple(found.moves), tuple(found.disturbed))
    return None


def apply_mig_plan(fleet: Sequence[MigGpu], plan: MigPlan) -> list[MigGpu]:
    """Run ``plan`` on a copy of ``fleet``, move by move; ValueError on any illegal step."""
    gpus = {g.uuid: g for g in fleet}

    def put(uuid: str, instances: tuple[MigInstance, ...]) -> None:
        gpu = gpus[uuid]
        problems = check_layout(CATALOG[gpu.model], [(i.profile, i.start) for i in instances])
        if problems:
            raise ValueError(f"{uuid}: {'; '.join(problems)}")
        gpus[uuid] = replace(gpu, instances=instances)

    def take(uuid: str, instance: str) -> None:
        left = tuple(i for i in gpus[uuid].instances if i.uuid != instance)
        if len(left) == len(gpus[uuid].instances):
            raise ValueError(f"{uuid} has no MIG instance {instance}")
        gpus[uuid] = replace(gpus[uuid], instances=left)

    for move in plan.moves:
        if move.kind == DESTROY:
            take(move.gpu, move.instance)
        elif move.kind == CREATE:
            new = MigInstance(
                f"{move.gpu}/{move.profile}@{move.start}", move.profile, move.start, move.sandbox
            )
            put(move.gpu, (*gpus[move.gpu].instances, new))
        elif move.kind == MIGRATE:
            new = MigInstance(
                f"{move.to_gpu}/{move.profile}@{move.to_start}", move.profile, move.to_start, move.sandbox
            )
            put(move.to_gpu, (*gpus[move.to_gpu].instances, new))
            take(move.gpu, move.instance)
        else:
            raise ValueError(f"unknown move kind {move.kind!r}")
    return [gpus[g.uuid] for g in fleet]


# -- shared GPUs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Share:
    sandbox: str
    milli: int  # thousandths of the GPU: gpu_milli in the trace, MPS thread % x 10 here
    memory_mib: int = 0
    models: tuple[str, ...] = ()  # GPU models it may run on; () for any
    # What the sandbox takes from its host besides the GPU: moving it to another host
    # needs this much room there (checked only when host capacities are given).
    cpu_milli: int = 0
    host_memory_mib: int = 0


@dataclass(frozen=True)
class SharedGpu:
    uuid: str
    model: str
    memory_mib: int
    shares: tuple[Share, ...] = ()
    capacity_milli: int = 1000
    available: bool = True  # False when drained: it takes no new share, and should empty
    host: str = ""
    # It takes only shares of the size of those it holds (an MPS GPU held to one size:
    # scheduler.cluster.GpuState.mps_one_size).
    one_size: bool = False


@dataclass
class HostRoom:
    """CPU and memory still free on a host, for migrations that cross hosts."""

    cpu_milli: int
    memory_mib: int


@dataclass(frozen=True)
class ShareMigration:
    sandbox: str
    from_gpu: str
    to_gpu: str
    milli: int


@dataclass(frozen=True)
class SharePlan:
    migrations: tuple[ShareMigration, ...]
    frees: tuple[str, ...]  # GPUs left with no share once the migrations ran


@dataclass
class _Bin:
    gpu: SharedGpu
    index: int
    milli: int
    memory: int
    received: bool = False  # a destination is never emptied: its shares would move twice

    def takes(self, share: Share, source_host: str, rooms: dict[str, HostRoom] | None) -> bool:
        if not (
            self.gpu.available
            and self.milli + share.milli <= self.gpu.capacity_milli
            and self.memory + share.memory_mib <= self.gpu.memory_mib
            and (not share.models or self.gpu.model in share.models)
            and not (self.gpu.one_size and any(_size(s) != _size(share) for s in self.gpu.shares))
        ):
            return False
        if rooms is None or self.gpu.host == source_host:
            return True
        room = rooms.get(self.gpu.host)
        return (
            room is not None
            and room.cpu_milli >= share.cpu_milli
            and (room.memory_mib >= share.host_memory_mib)
        )


def _size(share: Share) -> tuple[int, int]:
    return share.milli, share.memory_mib


def _book_host(rooms: dict[str, HostRoom] | None, source: str, dest: str, share: Share, sign: int) -> None:
    """Move (sign=1) or give back (sign=-1) a share's CPU and memory between two hosts."""
    if rooms is None or source == dest:
        return
    for host, direction in ((dest, -sign), (source, sign)):
        if host in rooms:
            rooms[host].cpu_milli += direction * share.cpu_milli
            rooms[host].memory_mib += direction * share.host_memory_mib


def plan_consolidation(
    gpus: Sequence[SharedGpu],
    max_migrations: int | None = None,
    hosts: dict[str, HostRoom] | None = None,
) -> SharePlan:
    """Free whole GPUs by moving shares off the emptiest ones; see the module docstring.

    Drained GPUs go first, whatever their load. ``max_migrations`` caps the plan; a GPU is
    only emptied if all its shares fit within the cap. With ``hosts`` (CPU and memory left
    per host; not modified), a share may also move to another host that has room for it.
    """
    rooms = {h: HostRoom(r.cpu_milli, r.memory_mib) for h, r in hosts.items()} if hosts else None
    bins = [
        _Bin(g, i, sum(s.milli for s in g.shares), sum(s.memory_mib for s in g.shares))
        for i, g in enumerate(gpus)
    ]
    order = sorted(
        (b for b in bins if b.gpu.shares),
        key=lambda b: (b.gpu.available, len(b.gpu.shares), b.milli, b.index),
    )
    freed: set[int] = set()
    migrations: list[ShareMigration] = []
    for source in order:
        if source.received or (
            max_migrations is not None and len(migrations) + len(source.gpu.shares) > max_migrations
        ):
            continue
        moved: list[tuple[Share, _Bin]] = []
        for share in sorted(source.gpu.shares, key=lambda s: (-s.milli, -s.memory_mib, s.sandbox)):
            fitting = [
                b
                for b in bins
                if b is not source
                and b.index not in freed
                and b.milli > 0
                and b.takes(share, source.gpu.host, rooms)
            ]
            if not fitting:
                break
            # Best fit: the fullest GPU that still takes it leaves the most room elsewhere.
            dest = min(fitting, key=lambda b: (b.gpu.capacity_milli - b.milli - share.milli, b.index))
            dest.milli += share.milli
            dest.memory += share.memory_mib
            _book_host(rooms, source.gpu.host, dest.gpu.host, share, 1)
            moved.append((share, dest))
        if len(moved) < len(source.gpu.shares):
            for share, dest in moved:
                dest.milli -= share.milli
                dest.memory -= share.memory_mib
                _book_host(rooms, source.gpu.host, dest.gpu.host, share, -1)
            continue
        for share, dest in moved:
            dest.received = True
            migrations.append(ShareMigration(share.sandbox, source.gpu.uuid, dest.gpu.uuid, share.milli))
        source.milli = source.memory = 0
        freed.add(source.index)
    return SharePlan(tuple(migrations), tuple(b.gpu.uuid for b in bins if b.index in freed))


def apply_share_plan(gpus: Sequence[SharedGpu], plan: SharePlan) -> list[SharedGpu]:
    """Run ``plan`` on a copy of ``gpus``; ValueError if a share is missing or a GPU overflows."""
    by_uuid = {g.uuid: g for g in gpus}
    for move in plan.migrations:
        source, dest = by_uuid[move.from_gpu], by_uuid[move.to_gpu]
        share = next((s for s in source.shares if s.sandbox == move.sandbox), None)
        if share is None:
            raise ValueError(f"{move.from_gpu} holds no share of {move.sandbox}")
        shares = (*dest.shares, share)
        if (
            sum(s.milli for s in shares) > dest.capacity_milli
            or sum(s.memory_mib for s in shares) > dest.memory_mib
        ):
            raise ValueError(f"{move.to_gpu} would be over capacity")
        by_uuid[dest.uuid] = replace(dest, shares=shares)
        by_uuid[source.uuid] = replace(
            source, shares=tuple(s for s in source.shares if s.sandbox != move.sandbox)
        )
    return [by_uuid[g.uuid] for g in gpus]

"""What the placement policy expects to be asked for next, learned from what was asked so far.

FGD's fragmentation measure, and the policy built on it, score a node by how well the
*typical* requests could still use what it has free. The FGD paper reads the typical pods
from the whole trace it then replays: knowledge of the future that a scheduler does not
have. ``WorkloadModel`` learns them online instead, from the requests it has seen (in the
portal the recent requests, in a replay the pods already arrived), and exposes them as
FGD does: the commonest shapes that together make up 95 % of the requests, with their
probabilities.

Nothing is published before ``MIN_OBSERVED`` requests: until then the policy packs, as if
one whole GPU were the typical request. The typical pods change as requests arrive, and
every change invalidates the scores that depend on them, so the model is then republished
on a geometric schedule (after 200, 400, 800 ... observations, then every
``REFRESH_EVERY``): often while little is known, rarely once the mix has settled.
``version`` says which publication a score was computed with.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from scheduler.cluster import CPU_ONLY, MIG, Request

MILLI = 1000  # one whole GPU, in milli-GPU
TYPICAL_THRESHOLD = 0.95  # FGD's target workload covers this share of the requests
# The first publication. The commonest shapes of a few dozen requests are mostly chance
# (most seen once): before, the model published after the first request (one shape, 100 %)
# and again at 16, 32 ... Waiting for 200 made no measurable difference on the default
# trace (live replay, seeds 42-51: 4.06 -> 4.02 % unallocated at arrived 100 %, within
# the seeds' noise), but a policy that packs until it knows something is easier to reason
# about than one steered by its first handful of requests.
MIN_OBSERVED = 200
# Republish at least this often once the geometric schedule has stretched past it.
REFRESH_EVERY = 4096
# The portal forgets requests older than this many observations: the mix of a lab changes.
DEFAULT_WINDOW = 20_000


@dataclass(frozen=True, slots=True)
class TypicalPod:
    """A common request shape: host CPU, milli-GPU per GPU, GPU count, accepted GPU models."""

    cpu_milli: int
    gpu_milli: int
    num_gpu: int
    models: tuple[str, ...]
    probability: float

    @property
    def sharing(self) -> bool:
        """Part of one GPU (an MPS share, a time-slice replica)."""
        return self.num_gpu == 1 and 0 < self.gpu_milli < MILLI


Shape = tuple[int, int, int, tuple[str, ...]]  # (cpu_milli, gpu_milli, num_gpu, models)


def observed_shape(request: Request) -> Shape | None:
    """What a ``WorkloadModel`` counts of a live request, in the shape of FGD's pods: CPU,
    milli per GPU (``Request.gpu_milli``: 1000 for whole GPUs, an MPS share's threads x 10, a
    time-slice replica a quarter), GPU count, accepted models; no GPU for a CPU-only request.
    None for MIG: MIG GPUs serve MIG slices only and the measures leave them out."""
    if request.mode == MIG:
        return None
    if request.mode == CPU_ONLY:
        return (request.cpu_milli, 0, 0, request.gpu_models)
    return (request.cpu_milli, request.gpu_milli, request.gpu_count, request.gpu_models)


def accessible(model: str, models: tuple[str, ...]) -> bool:
    """An empty list takes any GPU model; otherwise ``model`` must be one listed."""
    return not models or model in models


def typical_of(counts: Counter[Shape], threshold: float = TYPICAL_THRESHOLD) -> list[TypicalPod]:
    """The commonest shapes that together make up ``threshold`` of ``counts``.

    Ties in popularity go to the larger shape, field by field, as in the paper's sort; the
    kept prefix is renormalised to probabilities.
    """
    ranked = sorted(counts.items(), key=lambda kv: (kv[1], _sort_key(kv[0])), reverse=True)
    total = sum(counts.values())
    kept: list[tuple[Shape, int]] = []
    covered = 0
    for shape, count in ranked:
        if covered >= threshold * total:
            break
        kept.append((shape, count))
        covered += count
    return [TypicalPod(cpu, milli, num, models, count / covered) for (cpu, milli, num, models), count in kept]


def _sort_key(shape: Shape) -> tuple[int, int, int, str]:
    cpu, milli, num, models = shape
    return (cpu, milli, num, "|".join(models))


class WorkloadModel:
    """Typical request shapes, learned from the requests observed so far.

    ``observe`` takes a request's id and shape; an id seen before is ignored, so a queue
    can be shown to the model every cycle. With ``window`` only the latest that many
    observations count.
    """

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self._counts: Counter[Shape] = Counter()
        self._recent: deque[tuple[int, Shape]] = deque()
        self._seen: set[int] = set()
        self._observed = 0
        self._next_refresh = MIN_OBSERVED
        self.version = 0
        self.typical: list[TypicalPod] = []
        # The part of the GPU demand that comes in requests for several GPUs, typical or
        # not: what keeps whole hosts whole for them (see ``StrandedCapacity``).
        self.multi_gpu_share = 0.0
        # Every multi-GPU request shape seen, with its part of the multi-GPU demand: what
        # ``MultiGpuRoom`` keeps room for (few are common enough to be typical).
        self.multi_gpu: list[TypicalPod] = []

    @property
    def observed(self) -> int:
        return self._observed

    def observe(self, key: int, shape: Shape) -> bool:
        """Count one request; True when the typical shapes were republished by it."""
        if key in self._seen:
            return False
        self._seen.add(key)
        self._counts[shape] += 1
        self._recent.append((key, shape))
        if self.window is not None and len(self._recent) > self.window:
            old_key, old_shape = self._recent.popleft()
            self._seen.discard(old_key)
            self._counts[old_shape] -= 1
            if not self._counts[old_shape]:
                del self._counts[old_shape]
        self._observed += 1
        if self._observed >= self._next_refresh:
            self.publish()
            return True
        return False

    def adopt(
        self, typical: list[TypicalPod], multi_gpu_share: float, multi_gpu: list[TypicalPod] | None = None
    ) -> None:
        """Take another model's publication as this one's: for a process that does not see
        the requests itself (the web server mirrors the control worker's model). A new
        version only when it differs, so scores computed with the same publication stay."""
        multi_gpu = multi_gpu or []
        if (typical, multi_gpu_share, multi_gpu) == (self.typical, self.multi_gpu_share, self.multi_gpu):
            return
        self.typical = list(typical)
        self.multi_gpu_share = multi_gpu_share
        self.multi_gpu = list(multi_gpu)
        self.version += 1

    def publish(self) -> None:
        self.typical = typical_of(self._counts)
        demand = sum(milli * num_gpu * n for (_, milli, num_gpu, _), n in self._counts.items())
        multi = sum(milli * num_gpu * n for (_, milli, num_gpu, _), n in self._counts.items() if num_gpu > 1)
        self.multi_gpu_share = multi / demand if demand else 0.0
        self.multi_gpu = [
            TypicalPod(cpu, milli, num_gpu, models, milli * num_gpu * n / multi)
            for (cpu, milli, num_gpu, models), n in sorted(
                self._counts.items(), key=lambda kv: _sort_key(kv[0])
            )
            if num_gpu > 1 and n
        ]
        self.version += 1
        self._next_refresh = self._observed + min(max(self._observed, MIN_OBSERVED), REFRESH_EVERY)

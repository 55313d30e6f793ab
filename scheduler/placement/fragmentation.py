"""FGD's node fragmentation F(n): the GPU milli that the target workload cannot use.

For each typical pod m (probability p_m), f(n, m) is the node's whole free GPU milli G
when m cannot run there (CPU-only, wrong model, too few GPUs, too little CPU), else the
free milli of the GPUs too small for m. F(n) = sum of p_m f(n, m). Go's
``NodeGpuShareFragAmount`` accumulates per category and then sums the categories; the
same order is kept so that equal inputs give bit-equal sums, which keeps the FGD score's
truncated ties where the paper has them.
"""

from __future__ import annotations

from bisect import bisect_left

from scheduler.placement.workload import TypicalPod, accessible

# How a typical pod relates to a node model, fixed once per model.
_CPU_ONLY, _NO_ACCESS, _GPU = 0, 1, 2

FragKey = tuple[str, int, tuple[int, ...]]  # (GPU model, CPU left, free milli per GPU ascending)


class Fragmentation:
    def __init__(self, typical: list[TypicalPod]) -> None:
        self.typical = typical
        self._by_model: dict[str, list[tuple[int, int, int, float, int]]] = {}
        self._memo: dict[FragKey, float] = {}

    def _entries(self, model: str) -> list[tuple[int, int, int, float, int]]:
        entries = self._by_model.get(model)
        if entries is None:
            entries = []
            for t in self.typical:
                if t.gpu_milli == 0:
                    kind = _CPU_ONLY
                elif not accessible(model, t.models):
                    kind = _NO_ACCESS
                else:
                    kind = _GPU
                entries.append((t.cpu_milli, t.gpu_milli, t.num_gpu, t.probability, kind))
            self._by_model[model] = entries
        return entries

    def amount(self, model: str, cpu_left: int, free_sorted: tuple[int, ...]) -> float:
        """F(n) for a node state; ``free_sorted`` must be ascending (F ignores GPU order)."""
        key = (model, cpu_left, free_sorted)
        cached = self._memo.get(key)
        if cached is not None:
            return cached
        total = sum(free_sorted)
        gpus = len(free_sorted)
        q1 = q2 = q4 = xl = xr = na = 0.0
        for cpu, milli, num, p, kind in self._entries(model):
            if kind == _CPU_ONLY:
                if cpu_left >= cpu:
                    xl += p * total
                else:
                    xr += p * total
            elif kind == _NO_ACCESS:
                na += p * total
            else:
                small = bisect_left(free_sorted, milli)  # GPUs with less than milli free
                if gpus - small >= num:
                    if cpu_left >= cpu:
                        q2 += p * sum(free_sorted[:small])  # satisfied: only too-small GPUs count
                    else:
                        q4 += p * total
                elif cpu_left >= cpu:
                    q2 += p * total
                else:
                    q1 += p * total
        value = 0.0 + q1 + q2 + q4 + xl + xr + na
        self._memo[key] = value
        return value

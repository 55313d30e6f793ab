"""What each sharing mode gives a sandbox, and what it does not: the one place gpushare
says it.

A tier's description is an operator's free text, and nothing stops it from promising "¼
GPU" for a time-slice replica. So the product states each mode's terms itself, from here,
wherever a sandbox of that mode is offered (the request form and its live answer), shown
(the sandbox page, the fleet and GPU pages, the API and the CLI through it) or billed (the
invoice page). Templates render these words through ``{% sharing_terms %}``
(``portal/catalog/templatetags/sharing.py``); the API gives ``SharingTerms.text``. Nothing
else restates them (``tests/portal/catalog/test_sharing_terms.py`` checks the templates).

What the words rest on (NVIDIA's documents, read in the third GPU review,
``gpu-desk-review-3.md`` §3):

- **Whole GPU**: the sandbox alone holds the device.
- **MIG**: memory and SMs partitioned by the hardware; a slice is its own fault domain.
- **MPS**: the MPS server enforces a thread percentage and a pinned-memory limit on each
  client *process*; ``EXCLUSIVE_PROCESS`` compute mode leaves the server the GPU's only
  context, so a tenant cannot run outside MPS; the agent sums a sandbox's processes'
  memory and watches it against its share. A fatal fault in one client is delivered to
  every client of the server.
- **Time-slice**: processes in the DEFAULT compute mode each get a context, and the GPU
  switches between contexts (not between replicas): nothing is reserved, memory goes to
  whoever allocates first, and all replicas are one fault domain (the k8s device plugin's
  README says the same of its time-slicing). The replica count only prices it and counts
  it in quota and fair share (1/N of a GPU). The agent watches each replica's memory
  against 1/N of the GPU's and its utilization is its own processes'.
"""

from __future__ import annotations

from dataclasses import dataclass

# The request modes (catalog.SharingMode values, scheduler.cluster's modes), spelled here
# as plain strings so that the models can take their labels from this module.
DEDICATED, MIG, MPS, TIMESLICE, CPU = "dedicated", "mig", "mps", "timeslice", "cpu"


@dataclass(frozen=True)
class SharingTerms:
    """One mode's terms: a label, one sentence, what it gives, what it does not, and how it
    is billed and counted (and what that price is not)."""

    mode: str
    label: str
    summary: str
    gives: tuple[str, ...]
    lacks: tuple[str, ...]
    billing: str

    @property
    def text(self) -> str:
        """All of it as plain text: the API's field and the CLI's line."""
        parts = [self.summary]
        if self.gives:
            parts.append("It gives: " + "; ".join(self.gives) + ".")
        if self.lacks:
            parts.append("It does not give: " + "; ".join(self.lacks) + ".")
        parts.append(self.billing)
        return " ".join(parts)


LABELS: dict[str, str] = {
    DEDICATED: "Whole GPU",
    MIG: "MIG slice",
    MPS: "MPS share",
    TIMESLICE: "Time-slice replica",
    CPU: "CPU only",
}


def _others(replicas: int | None) -> str:
    """ "up to 3 others" on a GPU cut into 4 replicas; the rule where the GPU is not known
    yet (a request, the API's list)."""
    if replicas is None or replicas < 1:
        return "up to N-1 others (N: the replicas its GPU is cut into)"
    if replicas == 1:
        return "no other replica (its GPU is cut into one), though the GPU could be cut into more"
    return f"up to {replicas - 1} other{'s' if replicas > 2 else ''}"


def _fraction(replicas: int | None) -> str:
    return f"1/{replicas}" if replicas and replicas > 0 else "1/N"


def _memory_share(replicas: int | None, gpu_memory_mib: int | None) -> str:
    if replicas and gpu_memory_mib:
        return f"1/{replicas} of the GPU's memory ({gpu_memory_mib / replicas / 1024:.1f} GiB)"
    return f"{_fraction(replicas)} of the GPU's memory"


def terms(mode: str, replicas: int | None = None, gpu_memory_mib: int | None = None) -> SharingTerms:
    """The terms of ``mode``. For a time-slice replica, ``replicas`` (N, the replicas its
    GPU is cut into) and ``gpu_memory_mib`` make the figures concrete; without them the
    words give the rule. An unknown mode gets its own name and no promise."""
    label = LABELS.get(mode, mode)
    if mode == DEDICATED:
        return SharingTerms(
            mode,
            label,
            "Whole GPUs, for this sandbox alone: all of each one's memory and compute.",
            gives=(
                "all of each GPU's memory and compute",
                "its own fault domain: no other sandbox's program runs on its GPUs",
            ),
            lacks=(),
            billing="Billed, and counted in quota and fair share, as one GPU for each GPU it holds.",
        )
    if mode == MIG:
        return SharingTerms(
            mode,
            label,
            "A part of one GPU partitioned by the hardware (MIG), with memory and compute of its own.",
            gives=(
                "memory and compute isolated by the hardware: no other slice can use them",
                "its own fault domain: another slice's crash does not end its work",
            ),
            lacks=("nothing beyond its slice: the rest of the GPU stays out of reach, even when idle",),
            billing="Billed, and counted in quota and fair share, as its slice's part of the GPU.",
        )
    if mode == MPS:
        return SharingTerms(
            mode,
            label,
            "A limited part of one GPU's compute and memory, shared with other sandboxes through NVIDIA MPS.",
            gives=(
                "a compute limit (its percentage of the GPU's threads) and a memory limit, enforced "
                "for each of its processes by the GPU's MPS server",
                "the GPU in EXCLUSIVE_PROCESS compute mode, which keeps every tenant's processes "
                "inside MPS: none can leave it to take the whole GPU",
                "its memory watched as a whole: gpushare sums all its processes' memory and warns "
                "— or stops, as the tier says — a sandbox that holds more than its share",
            ),
            lacks=(
                "no fault isolation: one client's GPU fault ends every MPS client on the GPU, "
                "other sandboxes' work included",
                "no reserved memory bandwidth or cache: those are shared",
            ),
            billing="Billed, and counted in quota and fair share, as its part of the GPU.",
        )
    if mode == TIMESLICE:
        return SharingTerms(
            mode,
            label,
            f"Shares the whole GPU with {_others(replicas)}, taking turns: no memory or compute reservation.",
            gives=(
                "the whole GPU's compute and memory while its processes hold their turn (the GPU "
                "switches between processes, not between replicas)",
                f"its memory watched, not reserved: gpushare checks it against "
                f"{_memory_share(replicas, gpu_memory_mib)} and warns — or stops, as the tier says "
                "— a replica that holds more; the utilization shown is its own processes'",
            ),
            lacks=(
                "no memory reservation: another replica can use all the GPU's memory, and then "
                "this one cannot allocate",
                "no compute reservation: a replica running more processes gets more turns",
                "no fault isolation: one replica's crash can end the others' work",
            ),
            billing=f"Billed, and counted in quota and fair share, as {_fraction(replicas)} of a GPU: "
            "that is its price, not a part of the GPU set aside for it.",
        )
    if mode == CPU:
        return SharingTerms(
            mode,
            label,
            "Host CPU cores and memory only, no GPU.",
            gives=("its tier's CPU cores and memory on a GPU host",),
            lacks=("no GPU",),
            billing="Billed per hour of the sandbox; it takes no GPU quota.",
        )
    return SharingTerms(mode, label, f"Sharing mode {mode}.", gives=(), lacks=(), billing="")


def modes_text() -> str:
    """Every mode's terms in one paragraph: the API schema's description of a mode field."""
    return " ".join(f"{mode}: {terms(mode).text}" for mode in LABELS)


# The tier admin's reminder (the console's tier form and Django's admin): the product states
# each mode's terms itself, so a description adds what the tier is for, never a promise.
TIER_DESCRIPTION_HELP = (
    "What the tier is for (audience, workloads, price). gpushare itself states what its sharing "
    "mode gives and does not give, with every request, sandbox and invoice: do not promise more "
    "here (a time-slice replica is not “¼ GPU”)."
)


def tier_mode_help() -> str:
    """The tier form's help for its sharing mode: each mode's sentence, as users read it."""
    return "As gpushare states it to users: " + " ".join(
        f"{LABELS[mode]}: {terms(mode).summary}" for mode in LABELS
    )

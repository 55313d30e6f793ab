"""The people of the twin: projects with fair-share weights and quotas, their members, and a
tier for every pod shape of the trace, so that each pod becomes a request a user of the
portal could make.

A pod's CPU and memory are its tier's (the portal gives a sandbox its tier's limits), so
each (mode, CPU, memory) the trace uses has a tier of its own. A sharing pod asks for an
MPS share with thread % = milli / 10, as the replay's ``pod_request`` does; its GPU
memory share is the same fraction of the smallest GPU of the fleet (the trace has no
memory figure), which never binds before the thread share does on any GPU of the fleet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model

from portal.accounts.models import Membership, Project
from portal.catalog.models import PriorityClass, SandboxImage, SharingMode, Tier
from portal.quotas.models import QuotaPolicy
from scheduler.cluster import CPU_ONLY, DEDICATED, MPS
from scheduler.research.live_replay import pod_request
from scheduler.research.trace import NodeSpec, PodSpec

# Fair-share weights of the projects, in turn: a few big teams, more small ones.
WEIGHTS = (4.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0)
# As many GPUs as the request form takes: a pod larger than every node is still asked for,
# and waits, as the replay counts it failed.
MAX_GPUS = 8
USERS_PER_PROJECT = 4
# The longest request the twin's tiers allow, and what every request asks for when the twin
# runs without departures: beyond the backfill window, so nothing is reserved for a head
# whose blockers would end then, as in the replay, where nothing ends.
LONGEST = timedelta(days=30)


@dataclass
class Population:
    projects: list[Project]
    users: list[Any]  # users[i] is a member of projects[i % len(projects)]
    image: SandboxImage
    tiers: dict[tuple[str, int, int], Tier]
    smallest_gpu_mib: int

    def owner(self, user_id: int) -> Any:
        """The user whose id a sandbox row names (an owner stops their own sandbox)."""
        return self.users[self._index[user_id]]

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        return {user.pk: i for i, user in enumerate(self.users)}

    def member(self, seq: int) -> tuple[Any, Project]:
        """Who asks for the trace's ``seq``-th pod, and for which of their projects."""
        user = self.users[seq % len(self.users)]
        return user, self.projects[seq % len(self.users) % len(self.projects)]

    def tier_for(self, pod: PodSpec) -> Tier:
        return self.tiers[shape_key(pod)]

    def form_data(self, seq: int, pod: PodSpec, duration: timedelta) -> dict[str, Any]:
        """The request form's fields for the pod, as a user (or the API) would send them."""
        _user, project = self.member(seq)
        request = pod_request(seq, pod)
        data: dict[str, Any] = {
            "project": project.pk,
            "tier": self.tier_for(pod).pk,
            "image": self.image.pk,
            "isolation": "container",
            "duration_hours": max(1, round(duration.total_seconds() / 3600)),
        }
        if request.mode == DEDICATED:
            data["gpu_count"] = request.gpu_count
        elif request.mode == MPS:
            data["mps_thread_pct"] = request.mps_thread_pct
            # Whole GiB, as the form takes it, rounded down: the shares on a GPU never add
            # up to more than its memory while their threads fit (1 GiB at least).
            data["mps_memory_gib"] = max(1, self.smallest_gpu_mib * pod.gpu_milli // 1000 // 1024)
        return data


def shape_key(pod: PodSpec) -> tuple[str, int, int]:
    request = pod_request(0, pod)
    return (request.mode, pod.cpu_milli, pod.memory_mib)


def populate(
    pods: list[PodSpec],
    nodes: list[NodeSpec],
    gpu_memory_mib: dict[str, int],
    project_count: int = len(WEIGHTS),
) -> Population:
    """Projects, users and tiers for ``pods`` on ``nodes`` (in a fresh database)."""
    projects = []
    for i in range(project_count):
        weight = WEIGHTS[i % len(WEIGHTS)]
        project = Project.objects.create(name=f"Twin team {i}", slug=f"twin-{i}")
        # Limits that a cluster of this size gives a team; they never bind before capacity
        # does, so the placements can be compared with the replay's.
        QuotaPolicy.objects.create(
            project=project, weight=weight, max_live_sandboxes=100_000, max_gpus=100_000
        )
        projects.append(project)
    users = []
    User = get_user_model()
    for i in range(len(projects) * USERS_PER_PROJECT):
        user = User.objects.create_user(username=f"twin{i}", password=None)
        Membership.objects.create(user=user, project=projects[i % len(projects)], role=Membership.Role.MEMBER)
        users.append(user)
    image = SandboxImage.objects.create(
        name="twin", reference="gpushare/sandbox-base:1", command=["sleep", "infinity"]
    )
    priority, _ = PriorityClass.objects.get_or_create(name="standard", defaults={"value": 100})
    tiers: dict[tuple[str, int, int], Tier] = {}
    for pod in pods:
        key = shape_key(pod)
        if key in tiers:
            continue
        mode, cpu_milli, memory_mib = key
        tiers[key] = Tier.objects.create(
            name=f"twin {mode} {cpu_milli}m {memory_mib} MiB", slug=f"twin-{mode}-{cpu_milli}-{memory_mib}",
            sharing_mode={CPU_ONLY: SharingMode.CPU}.get(mode, mode), isolation_levels=["container"],
            price_per_gpu_hour_micros=1_000_000, priority_class=priority, max_duration=LONGEST,
            max_gpus=MAX_GPUS, cpu_limit=cpu_milli / 1000, memory_limit_mib=memory_mib,
        )  # fmt: skip
    smallest = min(gpu_memory_mib[n.model] for n in nodes if n.gpus)
    return Population(projects, users, image, tiers, smallest)

"""The platform in front of the test cluster (tests/slurm/cluster.py): a control worker, beat,
the web server and the Slurm gateway as their own processes, the gateway enrolled as a pool
under a prefix of its own, and a monitor on each node with the node's own host credential
(simulated GPUs: the cluster's GRES are fake), as docs/slurm.md deploys them."""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from django.conf import settings

from portal.fleet import credentials
from portal.launcher import AGENT_WORKER_FLAGS
from tests.e2e.platform import Platform, stopped_after
from tests.slurm.cluster import TENANT, SlurmCluster
from wire import broker_acl

MODELS = {"h100": "H100-80GB", "a100": "A100-80GB"}  # the cluster's GRES types, as the catalog names them


@contextmanager
def slurm_platform(cluster: SlurmCluster, where: Path, web: bool = True) -> Iterator[Platform]:
    """``platform.host`` is the gateway's prefix: node n1 is the host ``<prefix>n1``."""
    (where / "logs").mkdir(parents=True, exist_ok=True)
    platform = Platform(where / "var", where / "logs", heartbeat_s=1)
    platform.host = f"slurm{uuid.uuid4().hex[:6]}-"  # ACL users are the Redis server's, for every run
    celery = [sys.executable, "-m", "celery", "-A", "workers"]
    with contextlib.ExitStack() as leaving:
        # Last out: the jobs the platform's sandboxes left running (a stopped gateway cancels
        # nothing, as on a real cluster), so the next test finds the cluster as this one did.
        leaving.callback(cluster.cancel_jobs, "gpushare-")
        leaving.enter_context(stopped_after(platform))
        platform.start_control("control", celery)
        platform.start("beat", [*celery, "beat", "-s", str(where / "beat-schedule")], GPUSHARE_ROLE="beat")
        if web:
            platform.start_web()
        selectors = broker_acl.supports_selectors(redis.Redis.from_url(settings.REDIS_URL))
        own = {**credentials.issue(platform.host, pool=True).env(), "GPUSHARE_POOL_PREFIX": platform.host}
        if not selectors:
            del own["REDIS_URL"]
        platform.start(
            "gateway",
            [*celery, "worker", "-n", "slurm@%h", "-P", "threads", "-c", "8", *AGENT_WORKER_FLAGS,
             "--loglevel=INFO"],
            GPUSHARE_ROLE="agent", GPUSHARE_SLURM_URL=cluster.rest_url, GPUSHARE_SLURM_USER="root",
            GPUSHARE_SLURM_JWT_KEY_FILE=str(cluster.jwt_key), GPUSHARE_SLURM_RUN_AS=TENANT,
            GPUSHARE_SLURM_ACCOUNT=cluster.account, GPUSHARE_SLURM_OUTPUT_DIR=str(cluster.root / "output"),
            GPUSHARE_SLURM_SIMULATED_GPUS="true",
            GPUSHARE_SLURM_GPU_MODELS=",".join(f"{k}={v}" for k, v in MODELS.items()),
            GPUSHARE_SLURM_POLL_MS="500", SLURM_CONF=str(cluster.etc / "slurm.conf"), **own,
        )  # fmt: skip
        for node in cluster.nodes:
            host = f"{platform.host}{node.name}"
            node_own = credentials.issue(host).env()
            if not selectors:
                del node_own["REDIS_URL"]
            model = MODELS[node.gpu_model]
            platform.start(
                f"monitor-{node.name}", [sys.executable, "-m", "workers.slurm.monitor"],
                GPUSHARE_HOST=host, GPUSHARE_SLURM_NODE=node.name, GPU_BACKEND="simulated",
                GPUSHARE_SIM_GPUS=f"{model}:{node.gpus}", SLURM_CONF=str(cluster.etc / "slurm.conf"),
                **node_own,
            )  # fmt: skip
        yield platform

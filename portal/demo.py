"""The demo fleet that ``make run`` seeds and starts one simulated agent for each host."""

from __future__ import annotations

# host name -> GPUSHARE_SIM_GPUS spec for its agent (model:count[:mig=indices])
DEMO_HOSTS: dict[str, str] = {
    "sim-h100-a": "H100-80GB:4:mig=0,1",
    "sim-a100-b": "A100-80GB:4",
}
# What each demo host offers sandboxes besides its GPUs (GPUSHARE_SIM_HOST): the size of a
# real four-GPU server, two 48- or 64-core sockets with SMT (a Dell XE8640 with four H100s:
# 2 x 48 cores, 192 hardware threads; an HPE Apollo 6500 with four A100s: 2 x 64 cores, 256)
# and 1 TiB, 128 of those threads offered to sandboxes. The agents' default (64 threads,
# 512 GiB) left the two hosts 64 CPU-only sandboxes of two cores together: fewer than one
# such server holds, and a burst of 100 small batches queued 36 of them behind the first ones
# (BENCHMARKS.md, "A burst of requests").
DEMO_HOST_SIZE = "cpus=128,memory_gib=1024"
# Every demo GPU not in MIG mode follows demand: dedicated, MPS and time-slice requests all
# find room on the A100s and on the H100's two whole GPUs; the MIG GPUs serve MIG tiers.
DEMO_USERS = {"admin": "gpushare-admin", "alice": "alice-demo", "bob": "bob-demo"}

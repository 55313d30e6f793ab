"""The demo fleet that ``make run`` seeds and starts one simulated agent for each host."""

from __future__ import annotations

# host name -> GPUSHARE_SIM_GPUS spec for its agent (model:count[:mig=indices])
DEMO_HOSTS: dict[str, str] = {
    "sim-h100-a": "H100-80GB:4:mig=0,1",
    "sim-a100-b": "A100-80GB:4",
}
# Every demo GPU not in MIG mode follows demand: dedicated, MPS and time-slice requests all
# find room on the A100s and on the H100's two whole GPUs; the MIG GPUs serve MIG tiers.
DEMO_USERS = {"admin": "gpushare-admin", "alice": "alice-demo", "bob": "bob-demo"}

"""The demo fleet that ``make run`` seeds and starts one simulated agent for each host."""

from __future__ import annotations

# host name -> GPUSHARE_SIM_GPUS spec for its agent (model:count[:mig=indices])
DEMO_HOSTS: dict[str, str] = {
    "sim-h100-a": "H100-80GB:4:mig=0,1",
    "sim-a100-b": "A100-80GB:4",
}
# (host, GPU index) -> how the admin shares that GPU; the rest stay dedicated.
DEMO_SHARING: dict[tuple[str, int], str] = {
    ("sim-a100-b", 2): "mps",
    ("sim-a100-b", 3): "timeslice",
}
DEMO_USERS = {"admin": "gpushare-admin", "alice": "alice-demo", "bob": "bob-demo"}

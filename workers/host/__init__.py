"""The host agent's parts, each with one job; ``workers.agent`` puts them together.

- ``sandboxes``: what this host runs, shared by the parts under one lock.
- ``inventory``: the GPUs and the CPU and memory this host offers.
- ``lifecycle``: launching and stopping sandboxes (with their GPU's MPS daemon).
- ``reports``: the heartbeat and its report of every sandbox here, for reconcile.
- ``faults``: GPU faults: which drain the GPU, which are the tenant's own; one alert each.
- ``sampler``: the telemetry loop (samples, rollups, alert rules, batch output).
- ``utilization``: each sandbox's GPU utilization over a window, for idle culling.
- ``terminals``: a browser's terminal into a sandbox.

No ORM here: a GPU host runs these with nothing but the broker.
"""

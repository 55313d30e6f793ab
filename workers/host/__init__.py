"""The host agent and its parts, each with one job; ``workers.agent`` is its Celery entry.

- ``agent``: ``Agent``, the parts wired once, and the one object the tasks call.
- ``context``: ``HostContext``, the collaborators the parts share (no behaviour).
- ``agent_settings``: the agent's settings, read from the environment once.
- ``sandboxes``: what this host runs, shared by the parts under one lock.
- ``inventory``: the GPUs and the CPU and memory this host offers.
- ``lifecycle``: launching, warning and stopping sandboxes (with their GPU's MPS daemon).
- ``storage_meter``: what the sandboxes' read-write volumes hold.
- ``reports``: the heartbeat and its report of every sandbox here, for reconcile.
- ``faults``: GPU faults: which drain the GPU, which are the tenant's own; one alert each.
- ``sampler``: the telemetry loop (samples, rollups, alert rules, batch output).
- ``telemetry``, ``rollups``, ``alerts``, ``batch_output``: what the sampler publishes,
  folds, judges and ships.
- ``utilization``: each sandbox's GPU utilization over a window, for idle culling.
- ``moves``, ``checkpoint``: a fleet plan's stops and MIG re-layout; the operator's hook.
- ``terminals``: a browser's terminal into a sandbox, or its web app.
- ``selftest``: one sandbox launched and stopped before the agent takes tasks.
- ``agent_pool``: many simulated hosts in one process.

No ORM here: a GPU host runs these with nothing but the broker.
"""

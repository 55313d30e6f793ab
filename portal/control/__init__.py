"""The control layer: orchestration above the model apps, which never import it.

What the control worker (``workers/control.py``, which registers a handler here per task:
``portal/control/tasks.py``) and the console's operator pages set in motion across apps:
the scheduling cycle (``scheduling``), reconciliation of hosts with their agents' reports
(``reconcile``), lost hosts and stuck launches (``hosts``), fleet plans (``plans``), idle
culling (``culling``) and GPU faults (``faults``). A plain package: no models; every state
it changes goes through an app's actions (``portal.sandboxes.actions``,
``portal.fleet.actions``).
"""

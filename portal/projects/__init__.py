"""The project pages (list, detail with usage and quota bars, members): pages only, no models.

They show what several apps own (accounts' projects and members, quotas, billing's usage,
telemetry's utilization, sandboxes' allocations), so they sit above all of them; the
Project model itself stays in ``portal.accounts``, the lowest app with models.
"""

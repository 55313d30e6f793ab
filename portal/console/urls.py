"""The operators' pages: fleet, plans, queue, audit, catalog, GPU actions, host enrolment."""

from django.urls import path

from portal.console import hosts, views

urlpatterns = [
    path("console/fleet/", views.fleet, name="console-fleet"),
    path("console/plans/", views.plans, name="console-plans"),
    path("console/queue/", views.queue, name="console-queue"),
    path("console/audit/", views.audit_log, name="console-audit"),
    path("console/catalog/", views.catalog, name="console-catalog"),
    path("console/catalog/<str:kind>/new/", views.catalog_edit, name="console-catalog-new"),
    path("console/catalog/<str:kind>/<int:pk>/", views.catalog_edit, name="console-catalog-edit"),
    path("console/plans/mig/", views.start_mig_relayout, name="console-start-mig-relayout"),
    path("console/plans/consolidate/", views.start_consolidation, name="console-start-consolidation"),
    path("console/gpus/<str:uuid>/mode/", views.set_gpu_mode, name="console-gpu-mode"),
    path("console/gpus/<str:uuid>/drain/", views.drain_gpu, name="console-drain-gpu"),
    path("console/gpus/<str:uuid>/undrain/", views.undrain_gpu, name="console-undrain-gpu"),
    path("console/hosts/", hosts.hosts, name="console-hosts"),
    path("console/hosts/issue/", hosts.issue, name="console-hosts-issue"),
    path("console/hosts/<slug:host>/rotate/", hosts.rotate, name="console-hosts-rotate"),
    path("console/hosts/<slug:host>/revoke/", hosts.revoke, name="console-hosts-revoke"),
]

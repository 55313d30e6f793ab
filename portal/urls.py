from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularSwaggerSplitView
from rest_framework.routers import DefaultRouter

from portal.accounts import token_views
from portal.accounts.api import ProjectViewSet
from portal.accounts.throttle import ThrottledLoginView, ThrottledPasswordResetView
from portal.api.schema import SchemaView
from portal.billing.api import InvoiceViewSet, PriceViewSet, UsageExportView, UsageRecordViewSet
from portal.billing.views import invoice_detail
from portal.console import views as console
from portal.identity import views as identity
from portal.projects import views as projects
from portal.quotas.api import QuotaViewSet
from portal.sandboxes import email_views
from portal.sandboxes import views as sandboxes
from portal.sandboxes.api import SandboxViewSet
from portal.telemetry import pages as telemetry_pages
from portal.telemetry import views as telemetry
from portal.telemetry.api import UtilizationView
from portal.telemetry.health import healthz
from portal.telemetry.metrics import metrics

router = DefaultRouter()
router.register("usage", UsageRecordViewSet, basename="usage")
router.register("sandboxes", SandboxViewSet, basename="sandbox")
router.register("prices", PriceViewSet, basename="price")
router.register("projects", ProjectViewSet, basename="project")
router.register("quotas", QuotaViewSet, basename="quota")
router.register("invoices", InvoiceViewSet, basename="invoice")

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="sandbox-list", permanent=False)),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics, name="metrics"),
    path("login/", ThrottledLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    # Single sign-on through OpenID Connect (404 until OIDC_RP_CLIENT_ID is set).
    path("oidc/authenticate/", identity.oidc_start, name="oidc_authentication_init"),
    path("oidc/callback/", identity.oidc_callback, name="oidc_authentication_callback"),
    # Django's own password views with the portal's templates (templates/registration/).
    path("account/password/", auth_views.PasswordChangeView.as_view(), name="password_change"),
    path("account/password/done/", auth_views.PasswordChangeDoneView.as_view(), name="password_change_done"),
    path("password-reset/", ThrottledPasswordResetView.as_view(), name="password_reset"),
    path("password-reset/sent/", auth_views.PasswordResetDoneView.as_view(), name="password_reset_done"),
    path(
        "password-reset/<uidb64>/<token>/",
        auth_views.PasswordResetConfirmView.as_view(),
        name="password_reset_confirm",
    ),
    path(
        "password-reset/done/", auth_views.PasswordResetCompleteView.as_view(), name="password_reset_complete"
    ),
    path("sandboxes/", sandboxes.sandbox_list, name="sandbox-list"),
    path("sandboxes/new/", sandboxes.sandbox_new, name="sandbox-new"),
    path("sandboxes/preview/", sandboxes.sandbox_preview, name="sandbox-preview"),
    path("notifications/", sandboxes.notifications, name="notifications"),
    path("account/notifications/", email_views.notification_email, name="notification-email"),
    path("account/tokens/", token_views.api_tokens, name="api-tokens"),
    path("account/tokens/<int:pk>/revoke/", token_views.api_token_revoke, name="api-token-revoke"),
    path("projects/", projects.project_list, name="project-list"),
    path("projects/<slug:slug>/", projects.project_detail, name="project-detail"),
    path("projects/<slug:slug>/members/", projects.project_members, name="project-members"),
    path("projects/<slug:slug>/invoices/<int:pk>/", invoice_detail, name="invoice-detail"),
    path("sandboxes/<int:pk>/", sandboxes.sandbox_detail, name="sandbox-detail"),
    path("sandboxes/<int:pk>/status/", sandboxes.sandbox_status, name="sandbox-status"),
    path("sandboxes/<int:pk>/stop/", sandboxes.sandbox_stop, name="sandbox-stop"),
    path("sandboxes/<int:pk>/extend/", sandboxes.sandbox_extend, name="sandbox-extend"),
    path("sandboxes/<int:pk>/output.txt", sandboxes.sandbox_output_download, name="sandbox-output"),
    path("sandboxes/<int:pk>/app/", sandboxes.open_app, name="sandbox-app"),
    path("sandboxes/<int:pk>/app/<path:path>", sandboxes.open_app),
    path("console/fleet/", console.fleet, name="console-fleet"),
    path("console/plans/", console.plans, name="console-plans"),
    path("console/queue/", console.queue, name="console-queue"),
    path("console/audit/", console.audit_log, name="console-audit"),
    path("console/catalog/", console.catalog, name="console-catalog"),
    path("console/catalog/<str:kind>/new/", console.catalog_edit, name="console-catalog-new"),
    path("console/catalog/<str:kind>/<int:pk>/", console.catalog_edit, name="console-catalog-edit"),
    path("console/plans/mig/", console.start_mig_relayout, name="console-start-mig-relayout"),
    path("console/plans/consolidate/", console.start_consolidation, name="console-start-consolidation"),
    path("console/gpus/<str:uuid>/mode/", console.set_gpu_mode, name="console-gpu-mode"),
    path("console/gpus/<str:uuid>/drain/", console.drain_gpu, name="console-drain-gpu"),
    path("console/gpus/<str:uuid>/undrain/", console.undrain_gpu, name="console-undrain-gpu"),
    path("console/gpus/<str:uuid>/", telemetry_pages.gpu_page, name="console-gpu"),
    path("console/heatmap/", telemetry_pages.heatmap, name="console-heatmap"),
    path("telemetry/gpus/<str:uuid>/history/", telemetry.gpu_history, name="telemetry-gpu-history"),
    path(
        "telemetry/sandboxes/<int:pk>/history/",
        telemetry.sandbox_history,
        name="telemetry-sandbox-history",
    ),
    path("telemetry/fleet/history/", telemetry.fleet_history, name="telemetry-fleet-history"),
    path("telemetry/alerts/", telemetry.alerts, name="telemetry-alerts"),
    path("admin/", admin.site.urls),
    path("api/v1/usage/export.csv", UsageExportView.as_view(), name="api-usage-export"),
    path("api/v1/utilization/", UtilizationView.as_view(), name="api-utilization"),
    path("api/v1/", include((router.urls, "api"), namespace="api")),
    path("api/schema/", SchemaView.as_view(), name="api-schema"),
    # The split view serves Swagger UI's start-up script as a file: no inline script for CSP.
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="api-schema"), name="api-docs"),
]

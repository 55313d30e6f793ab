"""An invoice's page, and the billing API (usage, prices, invoices, the usage export)."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from portal.billing.api import InvoiceViewSet, PriceViewSet, UsageExportView, UsageRecordViewSet
from portal.billing.views import invoice_detail

api_router = SimpleRouter()
api_router.register("usage", UsageRecordViewSet, basename="usage")
api_router.register("prices", PriceViewSet, basename="price")
api_router.register("invoices", InvoiceViewSet, basename="invoice")

urlpatterns = [
    path("projects/<slug:slug>/invoices/<int:pk>/", invoice_detail, name="invoice-detail"),
]

# Under /api/v1/ outside the ``api`` namespace, and before the router, whose
# ``usage/{id}.{format}`` would otherwise take "export.csv".
api_urlpatterns = [
    path("usage/export.csv", UsageExportView.as_view(), name="api-usage-export"),
]

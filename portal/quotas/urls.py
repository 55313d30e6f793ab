from rest_framework.routers import SimpleRouter

from portal.quotas.api import QuotaViewSet

api_router = SimpleRouter()
api_router.register("quotas", QuotaViewSet, basename="quota")

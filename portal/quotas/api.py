"""Read-only API: the quota of each project the caller can see."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, serializers, viewsets

from portal.accounts.permissions import api_projects
from portal.api.errors import ERRORS
from portal.api.pagination import BySlug
from portal.api.views import ApiView
from portal.quotas.departments import department_paths
from portal.quotas.models import QuotaPolicy


class QuotaSerializer(serializers.ModelSerializer[QuotaPolicy]):
    project: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    department = serializers.SerializerMethodField(
        help_text='The departments it belongs to, the top one first ("Physics / Optics"); empty for none.'
    )

    class Meta:
        model = QuotaPolicy
        fields = [
            "project",
            "department",
            "max_live_sandboxes",
            "max_gpus",
            "guaranteed_gpus",
            "weight",
            "max_gpu_hours_month",
        ]
        read_only_fields = fields

    def get_department(self, quota: QuotaPolicy) -> str:
        if quota.department is None:
            return ""
        paths = self.context.get("department_paths")
        return paths[quota.department_id] if paths else quota.department.path_text


class QuotaPages(BySlug):
    ordering = ("project_id",)  # unique: one quota per project


@extend_schema_view(
    list=extend_schema(
        summary="Quotas",
        description="The quota of each project you can see (projects without one have no row). "
        "Scope read:usage.",
        responses={200: QuotaSerializer(many=True), **ERRORS},
    )
)
class QuotaViewSet(ApiView, mixins.ListModelMixin, viewsets.GenericViewSet[QuotaPolicy]):
    serializer_class = QuotaSerializer
    pagination_class = QuotaPages
    queryset = QuotaPolicy.objects.none()  # for the schema; get_queryset scopes it

    def get_queryset(self) -> QuerySet[QuotaPolicy]:
        visible = QuotaPolicy.objects.filter(project__in=api_projects(self.request))
        return visible.select_related("project")

    def get_serializer_context(self) -> dict[str, Any]:
        # Every path in one query, however deep the tree (a path per row read its parents).
        return {**super().get_serializer_context(), "department_paths": department_paths()}

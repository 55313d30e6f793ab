"""Read-only API: prices (open tiers), the caller's projects with their role, and quotas."""

from __future__ import annotations

from typing import Any

from django.db.models import OuterRef, QuerySet, Subquery
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, serializers, viewsets

from portal.accounts.models import Membership, Project
from portal.accounts.permissions import api_projects
from portal.billing.api_common import ERRORS, ApiView, BySlug
from portal.catalog.models import Tier
from portal.quotas.models import QuotaPolicy


class PriceSerializer(serializers.ModelSerializer[Tier]):
    mode = serializers.CharField(source="sharing_mode")
    max_duration_hours = serializers.SerializerMethodField()

    class Meta:
        model = Tier
        fields = [
            "slug",
            "name",
            "description",
            "mode",
            "isolation_levels",
            "price_per_gpu_hour_micros",
            "currency",
            "max_gpus",
            "max_duration_hours",
        ]
        read_only_fields = fields

    def get_max_duration_hours(self, obj: Tier) -> float:
        return obj.max_duration.total_seconds() / 3600


@extend_schema_view(
    list=extend_schema(
        summary="Prices",
        description="Open tiers with their price per GPU-hour in micro-units of `currency`; a "
        "CPU-only tier (`mode` cpu) holds no GPU and charges that price per hour of each sandbox. "
        "Scope read:usage.",
        responses={200: PriceSerializer(many=True), **ERRORS},
    )
)
class PriceViewSet(ApiView, mixins.ListModelMixin, viewsets.GenericViewSet[Tier]):
    serializer_class = PriceSerializer
    pagination_class = BySlug
    queryset = Tier.objects.filter(active=True)


class ProjectSerializer(serializers.ModelSerializer[Project]):
    role = serializers.CharField(
        allow_null=True, help_text="Your role: manager, member or billing; null for an admin outside it."
    )

    class Meta:
        model = Project
        fields = ["slug", "name", "role", "created_at"]
        read_only_fields = fields


@extend_schema_view(
    list=extend_schema(
        summary="Projects",
        description="The projects you can see, with your role. Scope read:usage.",
        responses={200: ProjectSerializer(many=True), **ERRORS},
    )
)
class ProjectViewSet(ApiView, mixins.ListModelMixin, viewsets.GenericViewSet[Project]):
    serializer_class = ProjectSerializer
    pagination_class = BySlug
    queryset = Project.objects.none()  # for the schema; get_queryset scopes it

    def get_queryset(self) -> QuerySet[Project]:
        mine = Membership.objects.filter(project=OuterRef("pk"), user_id=int(self.request.user.pk or 0))
        role = mine.values("role")[:1]
        return api_projects(self.request).distinct().annotate(role=Subquery(role))


class QuotaSerializer(serializers.ModelSerializer[QuotaPolicy]):
    project: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )

    class Meta:
        model = QuotaPolicy
        fields = [
            "project",
            "max_live_sandboxes",
            "max_gpus",
            "guaranteed_gpus",
            "weight",
            "max_gpu_hours_month",
        ]
        read_only_fields = fields


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
        return QuotaPolicy.objects.filter(project__in=api_projects(self.request)).select_related("project")

"""Billing and self-service REST API (/api/v1/). Objects outside the caller's projects
are 404, exactly as in the HTML views."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from rest_framework import mixins, pagination, serializers, viewsets

from portal.accounts.access import visible_projects
from portal.billing.models import UsageRecord
from portal.sandboxes.models import Sandbox


class NewestFirst(pagination.CursorPagination):
    """Stable cursor pages even while new rows arrive: ordered by start time, then id."""

    ordering = ("-started_at", "-id")
    page_size_query_param = "page_size"
    max_page_size = 1000


class NewestRequestFirst(NewestFirst):
    ordering = ("-requested_at", "-id")


class UsageRecordSerializer(serializers.ModelSerializer[UsageRecord]):
    project: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    user: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    tier: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    duration_seconds = serializers.SerializerMethodField()

    class Meta:
        model = UsageRecord
        fields = [
            "id",
            "sandbox",
            "allocation_key",
            "project",
            "user",
            "tier",
            "gpu_model",
            "milli_gpu",
            "price_per_gpu_hour_micros",
            "currency",
            "started_at",
            "ended_at",
            "duration_seconds",
            "cost_micros",
        ]
        read_only_fields = fields

    def get_duration_seconds(self, obj: UsageRecord) -> float | None:
        return obj.duration.total_seconds() if obj.duration is not None else None


class UsageRecordViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Usage intervals of the caller's projects, newest first; closed ones carry their cost."""

    serializer_class = UsageRecordSerializer
    pagination_class = NewestFirst

    def get_queryset(self) -> QuerySet[UsageRecord]:
        return UsageRecord.objects.filter(project__in=visible_projects(self.request.user)).select_related(
            "project", "user", "tier"
        )


class SandboxSerializer(serializers.ModelSerializer[Sandbox]):
    project: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    owner: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    tier: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    host: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Sandbox
        fields = [
            "id",
            "project",
            "owner",
            "tier",
            "isolation",
            "state",
            "pending_reason",
            "host",
            "gpu_count",
            "mig_profile",
            "mps_memory_mib",
            "mps_thread_pct",
            "requested_at",
            "started_at",
            "ended_at",
        ]
        read_only_fields = fields


class SandboxViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = SandboxSerializer
    pagination_class = NewestRequestFirst

    def get_queryset(self) -> QuerySet[Sandbox]:
        return Sandbox.objects.filter(project__in=visible_projects(self.request.user)).select_related(
            "project", "owner", "tier", "host"
        )

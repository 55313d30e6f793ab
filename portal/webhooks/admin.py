"""Webhook endpoints (with their recent deliveries and a "rotate secret" action) and the
deliveries themselves (filterable, redeliverable)."""

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from portal.webhooks import deliveries
from portal.webhooks.models import WebhookDelivery, WebhookEndpoint

RECENT_DELIVERIES = 20


def rotation_grace() -> timedelta:
    return timedelta(hours=settings.WEBHOOK_SECRET_GRACE_HOURS)


class RecentDeliveryInline(admin.TabularInline):
    model = WebhookDelivery
    fields = ("event", "event_id", "attempts", "last_status", "last_error", "delivered_at", "next_attempt_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    verbose_name_plural = f"recent deliveries (last {RECENT_DELIVERIES})"

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[WebhookDelivery]:
        # The admin filters the inline's queryset by endpoint, so it cannot be sliced here:
        # keep the newest per endpoint by id instead.
        qs = super().get_queryset(request)
        endpoint_id = request.resolver_match.kwargs.get("object_id") if request.resolver_match else None
        if endpoint_id is None:
            return qs.none()
        recent = qs.filter(endpoint_id=endpoint_id).order_by("-pk").values_list("pk", flat=True)
        return qs.filter(pk__in=list(recent[:RECENT_DELIVERIES]))


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(admin.ModelAdmin):
    list_display = ("url", "project", "events", "active", "previous_secret_valid_until", "created_at")
    list_filter = ("active",)
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}
    inlines = (RecentDeliveryInline,)
    actions = ("rotate_secret",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # A secret is chosen when the endpoint is made; afterwards it changes only by
        # rotation, which keeps the old one valid for the grace period.
        if obj is None:
            return ("previous_secret_valid_until",)
        return ("secret", "previous_secret_valid_until")

    @admin.display(description="previous secret valid until")
    def previous_secret_valid_until(self, obj: WebhookEndpoint) -> str:
        expires = obj.previous_secret_expires_at
        if not obj.previous_secret or expires is None or expires <= timezone.now():
            return "-"
        return timezone.localtime(expires).strftime("%Y-%m-%d %H:%M %Z")

    @admin.action(description="Rotate secret (the old one stays valid for the grace period)")
    def rotate_secret(self, request: HttpRequest, queryset: QuerySet[WebhookEndpoint]) -> None:
        grace = rotation_grace()
        count = 0
        for endpoint in queryset:
            deliveries.do_rotate_secret(endpoint, grace)
            count += 1
        hours = grace.total_seconds() / 3600
        self.message_user(
            request,
            f"{count} endpoint secret(s) rotated; the previous secrets stay valid for {hours:g} h "
            "(WEBHOOK_SECRET_GRACE_HOURS). Give the receivers the new secrets.",
            messages.SUCCESS,
        )


class DeliveryStatusFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("delivered", "Delivered"), ("pending", "Pending"), ("failed", "Failed")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[WebhookDelivery]
    ) -> QuerySet[WebhookDelivery]:
        value = self.value()
        if value == "delivered":
            return queryset.filter(delivered_at__isnull=False)
        if value == "pending":
            return queryset.filter(delivered_at__isnull=True, next_attempt_at__isnull=False)
        if value == "failed":
            return queryset.filter(delivered_at__isnull=True, next_attempt_at__isnull=True)
        return queryset


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = (
        "event",
        "event_id",
        "endpoint",
        "status",
        "attempts",
        "last_status",
        "delivered_at",
        "created_at",
    )
    list_filter = ("event", DeliveryStatusFilter, "endpoint")
    search_fields = ("event_id",)
    list_select_related = ("endpoint",)
    readonly_fields = (
        "endpoint",
        "event",
        "event_id",
        "payload",
        "attempts",
        "last_status",
        "last_error",
        "attempt_log",
        "next_attempt_at",
        "delivered_at",
        "created_at",
    )
    actions = ("redeliver",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Redeliver selected (same event id)")
    def redeliver(self, request: HttpRequest, queryset: QuerySet[WebhookDelivery]) -> None:
        count = 0
        for delivery in queryset:
            try:
                deliveries.do_redeliver(delivery)
            except ValidationError as exc:  # pragma: no cover - defensive
                self.message_user(request, f"{delivery}: {exc}", messages.ERROR)
                continue
            count += 1
        self.message_user(request, f"{count} deliveries queued again.", messages.SUCCESS)

"""WebSocket consumers for live samples. Permission is checked once, at subscribe;
a refused subscription is accepted and closed with 4403 so the browser sees why."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.db.models import Q

from portal.accounts.access import visible_projects
from portal.sandboxes.models import Allocation, Sandbox
from workers.telemetry import FLEET_GROUP, gpu_group, sandbox_group

FORBIDDEN = 4403


class _SampleConsumer(AsyncJsonWebsocketConsumer):
    group: str = ""

    async def connect(self) -> None:
        await self.accept()
        group = await database_sync_to_async(self.authorize)(self.scope.get("user"))
        if group is None:
            await self.close(code=FORBIDDEN)
            return
        self.group = group
        await self.channel_layer.group_add(group, self.channel_name)

    async def disconnect(self, code: int) -> None:
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def gpu_sample(self, event: dict[str, Any]) -> None:
        await self.send_json(event)

    def authorize(self, user: Any) -> str | None:
        raise NotImplementedError


class SandboxSamples(_SampleConsumer):
    def authorize(self, user: Any) -> str | None:
        if user is None or not user.is_authenticated:
            return None
        sandbox_id = self.scope["url_route"]["kwargs"]["sandbox_id"]
        visible = Sandbox.objects.filter(pk=sandbox_id, project__in=visible_projects(user)).exists()
        return sandbox_group(sandbox_id) if visible else None


class GpuSamples(_SampleConsumer):
    def authorize(self, user: Any) -> str | None:
        if user is None or not user.is_authenticated:
            return None
        uuid = self.scope["url_route"]["kwargs"]["uuid"]
        if user.is_staff:
            return gpu_group(uuid)
        # A member sees a GPU while a sandbox of one of their projects holds it.
        holds = Allocation.objects.filter(
            Q(device_uuid=uuid) | Q(gpu__uuid=uuid),
            active=True,
            sandbox__project__in=visible_projects(user),
        ).exists()
        return gpu_group(uuid) if holds else None


class FleetSamples(_SampleConsumer):
    def authorize(self, user: Any) -> str | None:
        return FLEET_GROUP if user is not None and user.is_authenticated and user.is_staff else None

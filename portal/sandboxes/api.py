"""Self-service sandboxes over the API: list, get, create, stop, extend, and a sandbox's
history (events) and batch output. The preview of a request is the scheduling app's
(``portal/scheduling/api.py``), checked by ``checked_request`` here.

Creation and its preview go through the HTML request form (``SandboxRequestForm``), so the
API checks exactly what the page checks (``actions.check_request_sandbox`` behind it) and
names the field at fault the same way; this module only turns slugs into rows first. The
preview is the form's live answer (``portal/scheduling/preview.py``): starts now, or waits,
why, and the earliest start.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.db.models import Model, QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import exceptions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from portal.accounts.permissions import api_can_manage_sandbox, api_projects, api_requestable_projects
from portal.api import idempotency
from portal.api.errors import errors
from portal.api.filters import FILTERS, filter_by
from portal.api.pagination import CheckedPageSize, NewestRequestFirst
from portal.api.schema import list_and_retrieve_schema
from portal.api.strict import StrictSerializer, Text, WholeNumber, choices_message
from portal.api.text import refuse_unexpected_fields
from portal.api.views import ApiView
from portal.catalog.models import IsolationLevel, SandboxImage, SharingMode, Tier
from portal.catalog.sharing import terms
from portal.inputs import whole_number
from portal.sandboxes import actions, resume
from portal.sandboxes.forms import EXTEND_CHOICES_H, MIG_PROFILES, SandboxRequestForm
from portal.sandboxes.models import ENDED_STATES, Sandbox, SandboxEvent
from portal.sandboxes.output import read_output


class SandboxSerializer(serializers.ModelSerializer[Sandbox]):
    project: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    owner: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    tier: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    image: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(slug_field="name", read_only=True)
    host: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True, allow_null=True
    )
    max_duration_hours = serializers.SerializerMethodField()
    sharing_mode = serializers.CharField(
        source="tier.sharing_mode",
        read_only=True,
        help_text="The tier's: dedicated, mig, mps, timeslice, or cpu (CPU only: no GPU).",
    )
    sharing_terms = serializers.SerializerMethodField(
        help_text="What its sharing mode gives and does not give, in gpushare's words (the "
        "sandbox page's): e.g. that a time-slice replica shares the whole GPU and has no memory "
        "or compute reserved."
    )
    gpu_count = serializers.SerializerMethodField(
        help_text="Whole GPUs it asks for; 0 for a CPU-only sandbox."
    )

    class Meta:
        model = Sandbox
        fields = [
            "id",
            "name",
            "project",
            "owner",
            "tier",
            "image",
            "sharing_mode",
            "sharing_terms",
            "isolation",
            "state",
            "pending_reason",
            "launch_progress",
            "failure",
            "host",
            "attempt",
            "gpu_count",
            "nodes",
            "gpu_model",
            "mig_profile",
            "mps_memory_mib",
            "mps_thread_pct",
            "max_duration_hours",
            "batch",
            "command",
            "requested_at",
            "started_at",
            "ended_at",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "launch_progress": {"help_text": "While it starts: what its host is doing that takes time "
                                "(pulling its image), else empty."},
            "failure": {"help_text": "Why it failed, once it has; else empty."},
            "nodes": {"help_text": "Hosts it spans, gpu_count GPUs on each (one Slurm job); 1 for most."},
            "gpu_model": {"help_text": "The GPU model asked for; empty: any its tier offers."},
        }  # fmt: skip

    def get_max_duration_hours(self, obj: Sandbox) -> float:
        return obj.max_duration.total_seconds() / 3600

    def get_sharing_terms(self, obj: Sandbox) -> str:
        # The rule, not its GPU's figures: a list would otherwise read each sandbox's GPU.
        return terms(obj.tier.sharing_mode).text

    def get_gpu_count(self, obj: Sandbox) -> int:
        return 0 if obj.tier.cpu_only else obj.gpu_count


class SandboxCreateSerializer(StrictSerializer):
    """The request form's fields, with slugs (project, tier) and a name (image) for ids.
    Ranges and tier rules are the form's and ``check_request_sandbox``'s. Any other field
    (``privileged``, ``volumes``, ``network_mode``...) is refused, never ignored: the platform
    decides how a sandbox is confined, and a caller must not believe it asked otherwise."""

    project = Text(max_length=50, help_text="Project slug (you must be a manager or member).")
    tier = Text(max_length=40, help_text="Tier slug; see /api/v1/prices/.")
    image = Text(max_length=40, help_text="Sandbox image name (an allowed image, not a reference).")
    isolation = serializers.ChoiceField(
        choices=IsolationLevel.choices,
        default=IsolationLevel.CONTAINER,
        error_messages=choices_message(IsolationLevel.values),
    )
    gpu_count = WholeNumber(required=False, help_text="Dedicated tiers: 1 to the tier's max.")
    nodes = WholeNumber(
        required=False,
        help_text="Dedicated tiers on a Slurm cluster: one job over this many nodes, gpu_count GPUs each.",
    )
    gpu_model = Text(
        required=False,
        allow_blank=True,
        max_length=40,
        help_text="GPU tiers: the GPU model, one the tier offers (/api/v1/prices/); empty or absent: any.",
    )
    mig_profile = serializers.ChoiceField(
        choices=MIG_PROFILES,
        required=False,
        help_text="MIG tiers: the MIG profile.",
        error_messages=choices_message(MIG_PROFILES),
    )
    mps_memory_gib = WholeNumber(required=False, help_text="MPS tiers: memory share, 1-80 GiB.")
    mps_thread_pct = WholeNumber(required=False, help_text="MPS tiers: thread share, 1-100 %.")
    duration_hours = WholeNumber(default=1, help_text="1 to the tier's maximum duration.")
    run = serializers.ChoiceField(
        choices=["interactive", "batch"],
        default="interactive",
        error_messages=choices_message(["interactive", "batch"]),
    )
    command = Text(
        required=False,
        allow_blank=True,
        max_length=2000,
        help_text="Batch runs: the command, split like a shell.",
    )
    name = Text(required=False, allow_blank=True, max_length=60, help_text="A label for your lists.")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("command") and attrs.get("run") != "batch":
            raise exceptions.ValidationError(
                {"command": ["Only batch runs take a command: send run=batch, or leave the command out."]}
            )
        return attrs


class OutputSerializer(serializers.Serializer[Any]):
    start = serializers.IntegerField(help_text="Offset of the text's first byte in all the run printed.")
    end = serializers.IntegerField(help_text="Offset just past the text: the next call's `offset`.")
    kept_from = serializers.IntegerField(help_text="The oldest byte still kept; earlier ones are gone.")
    total = serializers.IntegerField(help_text="Bytes the run printed so far, kept or not.")
    missing = serializers.IntegerField(help_text="Bytes between start and end the host did not keep.")
    text = serializers.CharField(help_text="stdout and stderr together, UTF-8 (undecodable bytes replaced).")
    complete = serializers.BooleanField(help_text="The sandbox has ended: no more output will come.")


OUTPUT_LIMIT = 1024 * 1024


class AttemptSerializer(serializers.Serializer[Any]):
    number = serializers.IntegerField(help_text="1 for the first run, 2 for the next (GPUSHARE_ATTEMPT).")
    host = serializers.CharField(help_text="The host it was placed on.")
    placed_at = serializers.DateTimeField()
    ended_at = serializers.DateTimeField(allow_null=True)
    end = serializers.CharField(help_text="Why it ended: preempted, lost, moved, ended; empty while it runs.")
    end_message = serializers.CharField(help_text="The portal's words for why (GPUSHARE_LAST_END_MESSAGE).")
    current = serializers.BooleanField(help_text="The sandbox's current (or last) attempt.")


class SandboxEventSerializer(serializers.ModelSerializer[SandboxEvent]):
    actor: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True
    )

    class Meta:
        model = SandboxEvent
        fields = ["id", "at", "from_state", "to_state", "actor", "message"]
        read_only_fields = fields


class SandboxEventPage(serializers.Serializer[Any]):
    next = serializers.URLField(allow_null=True, help_text="The next page, or null at the end.")
    previous = serializers.URLField(allow_null=True)
    results = SandboxEventSerializer(many=True)


class OldestFirst(CheckedPageSize):
    """A sandbox's history in the order it happened."""

    ordering = ("at", "id")


class ExtendSerializer(StrictSerializer):
    hours = WholeNumber(choices=EXTEND_CHOICES_H, help_text="Hours to add to the limit.")


CREATE_EXAMPLE = OpenApiExample(
    "dedicated GPU",
    request_only=True,
    value={
        "project": "vision",
        "tier": "dedicated",
        "image": "busybox",
        "isolation": "container",
        "gpu_count": 1,
        "duration_hours": 2,
    },
)
BATCH_EXAMPLE = OpenApiExample(
    "MPS batch run",
    request_only=True,
    value={
        "project": "vision",
        "tier": "mps",
        "image": "busybox",
        "isolation": "container",
        "mps_memory_gib": 10,
        "mps_thread_pct": 25,
        "duration_hours": 1,
        "run": "batch",
        "command": "python train.py --epochs 3",
    },
)


# The fields that shape a request in each sharing mode; the others do not apply to it.
MODE_FIELDS: dict[str, tuple[str, ...]] = {
    SharingMode.DEDICATED: ("gpu_count", "nodes"),
    SharingMode.MIG: ("mig_profile",),
    SharingMode.MPS: ("mps_memory_gib", "mps_thread_pct"),
    SharingMode.TIMESLICE: (),
    SharingMode.CPU: (),
}


def _fields_the_mode_does_not_take(data: dict[str, Any], mode: str) -> dict[str, list[str]]:
    """An error for each field of another sharing mode: a time-slice request with
    ``mps_memory_gib`` would otherwise be placed without it, and its caller believe it got it."""
    takes = MODE_FIELDS.get(mode, ())
    return {
        name: [f"A {mode} tier does not take {name}; it takes {', '.join(takes) or 'none of these'}."]
        for fields in MODE_FIELDS.values()
        for name in fields
        if name not in takes and data.get(name) is not None
    }


def _listed(names: QuerySet[Any], most: int = 20) -> str:
    """``a, b, c`` (the first ``most``, then how many more), or ``none``."""
    first = [str(name) for name in names[: most + 1]]
    if not first:
        return "none"
    more = f" and {names.count() - most} more" if len(first) > most else ""
    return ", ".join(first[:most]) + more


def _form_data(request: Request, data: dict[str, Any]) -> tuple[dict[str, Any], tuple[Model, ...]]:
    """The form's POST data, slugs turned into ids, and the rows read for them (the form need
    not read them again); an unknown slug is a 400 on its field."""
    project = api_requestable_projects(request).filter(slug=data["project"]).first()
    tier = Tier.objects.filter(slug=data["tier"], active=True).first()
    image = SandboxImage.objects.filter(name=data["image"], active=True).first()
    # A refusal names what would do (a script or the command-line client has no form's
    # drop-downs to look at); the lists are read only when something was not found.
    problems: dict[str, list[str]] = {}
    if project is None:
        yours = _listed(api_requestable_projects(request).values_list("slug", flat=True))
        problems["project"] = [f"No such project among those you may start sandboxes in. Yours: {yours}."]
    if tier is None:
        open_tiers = Tier.objects.filter(active=True).values_list("slug", flat=True)
        problems["tier"] = [f"No such open tier. Open: {_listed(open_tiers)}."]
    if image is None:
        allowed = SandboxImage.objects.filter(active=True).order_by("name").values_list("name", flat=True)
        problems["image"] = [f"No such allowed image. Allowed: {_listed(allowed)}."]
    if problems:
        raise exceptions.ValidationError(problems)
    if misplaced := _fields_the_mode_does_not_take(data, tier.sharing_mode):  # type: ignore[union-attr]
        raise exceptions.ValidationError(misplaced)
    form_data = {k: v for k, v in data.items() if v is not None}
    form_data.update(project=project.pk, tier=tier.pk, image=image.pk)  # type: ignore[union-attr]
    return form_data, (project, tier, image)  # type: ignore[return-value]


def checked_request(request: Request, *, for_create: bool) -> actions.SandboxRequest:
    """The body checked as the request form checks it (``for_create``: the quota is left to
    ``do_request_sandbox``, under its lock); a 400 naming each field at fault."""
    shape = SandboxCreateSerializer(data=request.data)
    shape.is_valid(raise_exception=True)
    form_data, read = _form_data(request, dict(shape.validated_data))
    form = SandboxRequestForm(form_data, user=request.user, for_create=for_create, read=read)
    if not form.is_valid() or form.request_obj is None:
        raise exceptions.ValidationError(
            {
                ("non_field_errors" if k == "__all__" else k): [str(e) for e in v]
                for k, v in form.errors.items()
            }
        )
    return form.request_obj


@list_and_retrieve_schema(
    listed="Sandboxes",
    description="Newest request first, cursor pages. Scope read:usage. `user` is the owner; the "
    "period filters the request time.",
    one="One sandbox",
    serializer=SandboxSerializer,
)
class SandboxViewSet(ApiView, viewsets.ReadOnlyModelViewSet[Sandbox]):
    serializer_class = SandboxSerializer
    pagination_class = NewestRequestFirst
    action_parameters = {"output": ("offset", "limit", "attempt"), "events": ("cursor", "page_size")}
    filters = FILTERS
    queryset = Sandbox.objects.none()  # for the schema; get_queryset scopes it

    def get_queryset(self) -> QuerySet[Sandbox]:
        qs = Sandbox.objects.filter(project__in=api_projects(self.request))
        if self.action == "list":
            qs = filter_by(self.request.query_params, qs, user_field="owner", time_field="requested_at")
        return qs.select_related("project", "owner", "tier", "image", "host")

    def _managed(self) -> Sandbox:
        sandbox = self.get_object()  # 404 outside the caller's projects
        if not api_can_manage_sandbox(self.request, sandbox):
            raise exceptions.PermissionDenied(
                "Only the owner, a project manager or an admin can change this sandbox."
            )
        return sandbox

    def _answer(self, sandbox_id: int, code: int = status.HTTP_200_OK) -> Response:
        sandbox = self.get_queryset().get(pk=sandbox_id)
        return Response(SandboxSerializer(sandbox).data, status=code)

    @extend_schema(
        summary="Request a sandbox",
        description="The request form's fields and checks. Scope write:sandboxes. Send an "
        "Idempotency-Key so that a retry cannot start a second sandbox.",
        parameters=[idempotency.PARAMETER],
        request=SandboxCreateSerializer,
        examples=[CREATE_EXAMPLE, BATCH_EXAMPLE],
        responses={201: SandboxSerializer, **errors(400, 401, 403, 422, 429)},
    )
    @idempotency.idempotent
    def create(self, request: Request) -> Response:
        req = checked_request(request, for_create=True)
        try:
            sandbox = actions.do_request_sandbox(request.user, req)
        except actions.SandboxRequestError as exc:  # the quota, checked under the project's lock
            raise exceptions.ValidationError({exc.field: [exc.message]}) from exc
        # As made: its project, owner, tier and image are the rows the request was checked
        # with, so it is not read again (one query of a POST's, in a burst of them).
        return Response(SandboxSerializer(sandbox).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="A sandbox's history",
        description="Every transition (requested, queued, placing, starting, running, ...) and "
        "what was done to it (terminals opened, time added), oldest first, cursor pages. Scope "
        "read:usage.",
        parameters=[
            OpenApiParameter("cursor", OpenApiTypes.STR, description="The `next` of the page before."),
            OpenApiParameter("page_size", OpenApiTypes.INT, description="Events per page, 1 to 1000."),
        ],
        responses={200: SandboxEventPage, **errors(400, 401, 403, 404, 429)},
    )
    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str | None = None) -> Response:
        sandbox = self.get_object()  # 404 outside the caller's projects
        pages = OldestFirst()
        page = pages.paginate_queryset(
            SandboxEvent.objects.filter(sandbox=sandbox).select_related("actor"), request, view=self
        )
        return pages.get_paginated_response(SandboxEventSerializer(page, many=True).data)

    @extend_schema(
        summary="A sandbox's attempts",
        description="Each launch, oldest first: a sandbox queued again (preempted, its host lost, "
        "moved) runs again as its next attempt, told its number and why the last ended "
        "(docs/resume.md). Scope read:usage.",
        responses={200: AttemptSerializer(many=True), **errors(401, 403, 404, 429)},
    )
    @action(detail=True, methods=["get"], pagination_class=None)  # a handful: one plain list
    def attempts(self, request: Request, pk: str | None = None) -> Response:
        sandbox = self.get_object()  # 404 outside the caller's projects
        return Response(AttemptSerializer(resume.attempts_of(sandbox), many=True).data)

    @extend_schema(
        summary="A batch run's output",
        description="stdout and stderr together, as the run printed them; the newest "
        "BATCH_OUTPUT_MAX_BYTES are kept, during the run and after it. Without `offset`: the last "
        "`limit` bytes; with it: from there on (follow a running batch by passing the previous "
        "answer's `end`). Scope read:usage.",
        parameters=[
            OpenApiParameter("offset", OpenApiTypes.INT, description="Byte offset to read from."),
            OpenApiParameter("limit", OpenApiTypes.INT, description=f"Bytes at most, 1 to {OUTPUT_LIMIT}."),
            OpenApiParameter(
                "attempt",
                OpenApiTypes.INT,
                description="Which attempt's output (see attempts); the current one by default.",
            ),
        ],
        responses={200: OutputSerializer, **errors(400, 401, 403, 404, 429)},
    )
    @action(detail=True, methods=["get"])
    def output(self, request: Request, pk: str | None = None) -> Response:
        sandbox = self.get_object()  # 404 outside the caller's projects
        problems: dict[str, list[str]] = {}
        raw_offset, raw_limit = request.query_params.get("offset"), request.query_params.get("limit")
        offset = whole_number(raw_offset) if raw_offset is not None else None
        limit = whole_number(raw_limit, 1, OUTPUT_LIMIT) if raw_limit is not None else 256 * 1024
        if raw_offset is not None and offset is None:
            problems["offset"] = ["A whole number of bytes, 0 or more."]
        if limit is None:
            problems["limit"] = [f"A whole number of bytes from 1 to {OUTPUT_LIMIT}."]
        key = sandbox.allocation_key
        if (raw_attempt := request.query_params.get("attempt")) is not None:
            number = whole_number(raw_attempt, 1)
            ran = sandbox.attempts.filter(number=number).first() if number is not None else None
            if ran is None:
                problems["attempt"] = [f"An attempt this sandbox made: 1 to {sandbox.attempt}."]
            else:
                key = ran.allocation_key
        if problems:
            raise exceptions.ValidationError(problems)
        view = read_output(sandbox, offset, limit or OUTPUT_LIMIT, allocation_key=key)
        body = {
            "start": view.start, "end": view.end, "kept_from": view.kept_from, "total": view.total,
            "missing": view.missing, "text": view.text, "complete": sandbox.state in ENDED_STATES,
        }  # fmt: skip
        return Response(body)

    @extend_schema(
        summary="Stop a sandbox",
        description="A queued one ends at once, a running one is stopped by its host. Scope "
        "write:sandboxes; the owner, a project manager or an admin.",
        parameters=[idempotency.PARAMETER],
        request=None,
        responses={200: SandboxSerializer, **errors(401, 403, 404, 422, 429)},
    )
    @action(detail=True, methods=["post"])
    @idempotency.idempotent
    def stop(self, request: Request, pk: str | None = None) -> Response:
        sandbox = self._managed()
        body = request.data
        if body and not isinstance(body, Mapping):
            raise exceptions.ValidationError({"non_field_errors": ["Send no body, or {}."]})
        refuse_unexpected_fields(body, ())
        actions.do_request_stop(sandbox.pk, request.user)
        return self._answer(sandbox.pk)

    @extend_schema(
        summary="Extend a sandbox's time limit",
        description=f"Add {', '.join(map(str, EXTEND_CHOICES_H))} hours, within the tier's maximum "
        "duration. Scope write:sandboxes; the owner, a project manager or an admin.",
        parameters=[idempotency.PARAMETER],
        request=ExtendSerializer,
        examples=[OpenApiExample("two hours", value={"hours": 2}, request_only=True)],
        responses={200: SandboxSerializer, **errors(400, 401, 403, 404, 422, 429)},
    )
    @action(detail=True, methods=["post"])
    @idempotency.idempotent
    def extend(self, request: Request, pk: str | None = None) -> Response:
        sandbox = self._managed()
        body = ExtendSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            actions.do_extend(sandbox.pk, request.user, timedelta(hours=int(body.validated_data["hours"])))
        except actions.SandboxRequestError as exc:
            raise exceptions.ValidationError({"hours": [exc.message]}) from exc
        return self._answer(sandbox.pk)

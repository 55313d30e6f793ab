"""``POST /api/v1/sandboxes/preview/``: would a request start now? The request form's live
answer over the API (``preview.py``), for the same body as a create, checked the same way
(``portal.sandboxes.api.checked_request``). Routed before the sandboxes' router, whose
``sandboxes/{id}/`` would otherwise take "preview" for an id."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.api.errors import errors
from portal.api.views import ApiView
from portal.sandboxes.api import CREATE_EXAMPLE, SandboxCreateSerializer, checked_request
from portal.scheduling.preview import offer_other_models, preview_by_model, preview_request


class ModelAnswerSerializer(serializers.Serializer[Any]):
    model = serializers.CharField(help_text="A GPU model the request's tier offers.")
    verdict = serializers.ChoiceField(choices=["now", "waits", "refused"])
    message = serializers.CharField(help_text="As the request's own message, for this model.")
    position = serializers.IntegerField(help_text="Its place in line with this model; 0 unless it waits.")


class PreviewSerializer(serializers.Serializer[Any]):
    verdict = serializers.ChoiceField(
        choices=["now", "waits", "refused"],
        help_text="now: it would start at once; waits: it would queue; refused: a rule it breaks "
        "(rare here: a request the form refuses is a 400, as on create).",
    )
    message = serializers.CharField(help_text="Where it would start, or why it would wait or be refused.")
    host = serializers.CharField(help_text="The host it would start on (verdict now), else empty.")
    position = serializers.IntegerField(
        help_text="Its place among the waiting requests, 1 first; 0 unless it waits."
    )
    earliest_start = serializers.DateTimeField(
        allow_null=True,
        help_text="When it could start at the earliest (running sandboxes reaching their time "
        "limit), if it waits and that is known: an estimate, never a promise.",
    )
    alternatives = serializers.ListField(
        child=serializers.CharField(), help_text="What could start now instead, in the same sharing mode."
    )
    by_model = serializers.ListField(
        child=ModelAnswerSerializer(),
        help_text="The answer with each GPU model the tier offers (gpu_model set to it); empty "
        "when the tier offers one model or none.",
    )


class SandboxPreviewView(ApiView, APIView):
    @extend_schema(
        summary="Would a request start now?",
        description="The request form's live answer for the same body as a create, which it "
        "checks the same way (a 400 names each field at fault, the quota included); nothing is "
        "written. Scope write:sandboxes.",
        request=SandboxCreateSerializer,
        examples=[CREATE_EXAMPLE],
        responses={200: PreviewSerializer, **errors(400, 401, 403, 429)},
    )
    def post(self, request: Request) -> Response:
        asked = checked_request(request, for_create=False)
        answers = preview_by_model(request.user, asked)
        answer = offer_other_models(preview_request(request.user, asked), answers)
        by_model = [
            {"model": a.model, "verdict": a.preview.verdict, "message": a.preview.message,
             "position": a.preview.position}
            for a in answers
        ]  # fmt: skip
        body = {
            "verdict": answer.verdict, "message": answer.message, "host": answer.host,
            "position": answer.position, "earliest_start": answer.eta, "alternatives": answer.alternatives,
            "by_model": by_model,
        }  # fmt: skip
        return Response(PreviewSerializer(body).data)

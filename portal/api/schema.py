"""The OpenAPI schema, generated once per process and rendered once per format."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema, extend_schema_view
from drf_spectacular.views import SCHEMA_KWARGS, SpectacularAPIView
from rest_framework import serializers
from rest_framework.request import Request

from portal.api.errors import ERRORS
from portal.api.filters import FILTER_PARAMETERS

ViewSetT = TypeVar("ViewSetT", bound=Callable[..., Any])  # a class, as extend_schema_view takes it


class SchemaView(SpectacularAPIView):
    """drf-spectacular's schema view, answered from memory after the first request. The
    schema is public (the same for every caller: SERVE_PUBLIC) and changes only with the
    code, while generating it and rendering it as YAML took about 100 ms each, on every
    request.

    Renderings are kept by renderer class, a bounded set (a client's Accept parameters would
    not be). A ``?version=`` may be any string, as no ALLOWED_VERSIONS is set: such a request
    is generated as before and not kept."""

    _schema: ClassVar[dict[str, Any]] = {}  # "schema": the schema, once generated
    _rendered: ClassVar[dict[type, bytes]] = {}

    @extend_schema(**SCHEMA_KWARGS)  # as the parent's get: the schema's own route stays out of it
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        if "version" in request.query_params:
            return super().get(request, *args, **kwargs)
        if not self._schema:
            self._schema["schema"] = super().get(request, *args, **kwargs).data
        renderer = request.accepted_renderer
        content = self._rendered.get(type(renderer))
        if content is None:
            content = renderer.render(
                self._schema["schema"], renderer.media_type, self.get_renderer_context()
            )
            self._rendered[type(renderer)] = content
        disposition = f'inline; filename="{self._get_filename(request, None)}"'  # as the parent names it
        content_type = renderer.media_type + (f"; charset={renderer.charset}" if renderer.charset else "")
        return HttpResponse(content, content_type=content_type, headers={"Content-Disposition": disposition})


def list_and_retrieve_schema(
    *,
    listed: str,
    description: str,
    one: str,
    serializer: type[serializers.BaseSerializer[Any]],
    detail: type[serializers.BaseSerializer[Any]] | None = None,
    parameters: list[Any] = FILTER_PARAMETERS,
) -> Callable[[ViewSetT], ViewSetT]:
    """The schema of a read-only viewset's two operations: a filtered, paginated list
    (``listed``, ``description``) and one item (``one``, in ``detail`` when it shows more)."""
    return extend_schema_view(
        list=extend_schema(
            summary=listed, description=description, parameters=parameters,
            responses={200: serializer(many=True), **ERRORS},
        ),
        retrieve=extend_schema(summary=one, responses={200: detail or serializer, **ERRORS}),
    )  # fmt: skip

"""The mixin every API view starts with."""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions
from rest_framework.request import Request

from portal.api.text import check_query
from portal.inputs import whole_number


class ApiView:
    """Mixin for every API view. Scopes (TokenScopes) and rate limits come from
    REST_FRAMEWORK's defaults, so a view that forgets this mixin is still covered.

    ``filters`` names the query parameters of the list (or the plain view's GET); any other
    parameter is refused, as is a repeated or malformed one."""

    kwargs: dict[str, Any]
    filters: tuple[str, ...] = ()
    # Query parameters of other actions, by action name (e.g. {"output": ("offset", "limit")}).
    action_parameters: dict[str, tuple[str, ...]] = {}

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        action = getattr(self, "action", None)
        allowed = {"format"}  # DRF's format override (?format=json)
        if action == "list":
            allowed |= {"cursor", "page_size", *self.filters}
        elif action is None:  # a plain APIView: its GET takes the filters
            allowed |= set(self.filters)
        allowed |= set(self.action_parameters.get(action or "", ()))
        check_query(request.query_params, allowed)

    def get_object(self) -> Any:
        # An id PostgreSQL cannot hold (or not a number) is simply not found, not a 500.
        if whole_number(str(self.kwargs.get("pk", "0"))) is None:
            raise exceptions.NotFound()
        return super().get_object()  # type: ignore[misc]

"""The API's rate limits (REST_FRAMEWORK's DEFAULT_THROTTLE_CLASSES): a short burst and a
sustained hourly budget, per token, else per signed-in user, else per address.

Invalid tokens are throttled where tokens are checked (``portal.accounts.authentication``,
with the sign-in throttle), before any of these run."""

from __future__ import annotations

from typing import Any

from rest_framework import throttling
from rest_framework.request import Request
from rest_framework.settings import api_settings


class _RateFromSettings(throttling.UserRateThrottle):
    """Rates read at request time from REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], so tests
    and operators can change them without re-importing; keyed per token, else per user."""

    def get_rate(self) -> str | None:
        rate = api_settings.DEFAULT_THROTTLE_RATES.get(self.scope or "")
        return None if rate is None else str(rate)

    def allow_request(self, request: Request, view: Any) -> bool:
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request, view)

    def get_cache_key(self, request: Request, view: Any) -> str | None:
        # request.auth is the API token a request authenticated with (a stored row: it has a
        # pk); a session's is None.
        token_pk = getattr(request.auth, "pk", None)
        if token_pk is not None:
            ident = f"token-{token_pk}"
        elif request.user.is_authenticated:
            ident = f"user-{request.user.pk}"
        else:
            ident = f"ip-{self.get_ident(request)}"
        return self.cache_format % {"scope": self.scope, "ident": ident}


class BurstRate(_RateFromSettings):
    scope = "burst"


class SustainedRate(_RateFromSettings):
    scope = "sustained"

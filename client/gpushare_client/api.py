"""The portal's REST API over httpx: one call per ``routes.Route``, its answer as JSON, and
every way it can fail turned into a ``ClientError`` with the exit code that says what
happened (the API's error bodies: ``{"detail": "..."}`` or ``{"field": ["message"]}``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from gpushare_client import __version__
from gpushare_client.config import Credentials
from gpushare_client.exits import ClientError, Exit
from gpushare_client.routes import Route

TIMEOUT_S = 30.0
# The API's answers by status: 400 names fields, the others carry a "detail".
_STATUS_EXIT = {401: Exit.AUTH, 403: Exit.REFUSED, 404: Exit.NOT_FOUND, 409: Exit.REFUSED, 422: Exit.REFUSED}


def field_errors(body: Any) -> dict[str, list[str]]:
    """A 400's ``{"field": ["message", ...]}``, each value made a list of strings."""
    if not isinstance(body, dict):
        return {}
    found: dict[str, list[str]] = {}
    for name, problem in body.items():
        items = problem if isinstance(problem, list) else [problem]
        found[str(name)] = [str(item) for item in items]
    return found


def describe_fields(fields: Mapping[str, list[str]]) -> str:
    """``tier: No such open tier.; gpu_count: ...`` (``non_field_errors``: the message alone)."""
    return "; ".join(
        " ".join(messages) if name in ("non_field_errors", "detail") else f"{name}: {' '.join(messages)}"
        for name, messages in fields.items()
    )


class Api:
    def __init__(
        self,
        credentials: Credentials,
        *,
        timeout_s: float = TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = credentials.url
        self._client = httpx.Client(
            base_url=credentials.url,
            headers={
                "Authorization": f"Bearer {credentials.token}",
                "Accept": "application/json",
                "User-Agent": f"gpushare-client/{__version__}",
            },
            timeout=timeout_s,
            transport=transport,
            follow_redirects=False,  # a redirect would carry the token elsewhere
        )

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def call(
        self,
        route: Route,
        *,
        params: Mapping[str, str | int] | None = None,
        body: Mapping[str, Any] | None = None,
        **path: int | str,
    ) -> Any:
        """One request; its JSON answer, or a ClientError. A POST carries a fresh
        Idempotency-Key: the portal acts on it once even if a proxy sends it twice."""
        headers = {"Idempotency-Key": str(uuid.uuid4())} if route.method == "POST" else {}
        clean = {k: v for k, v in (params or {}).items() if v not in (None, "")}
        return self._send(route.method, route.format(**path), params=clean, body=body, headers=headers)

    def pages(
        self,
        route: Route,
        *,
        params: Mapping[str, str | int] | None = None,
        limit: int | None = None,
        **path: int | str,
    ) -> Iterator[dict[str, Any]]:
        """The items of a cursor-paged list, following ``next`` until ``limit`` items or the end."""
        clean = {k: v for k, v in (params or {}).items() if v not in (None, "")}
        page: Any = self._send(route.method, route.format(**path), params=clean, body=None, headers={})
        given = 0
        while True:
            results = page.get("results") if isinstance(page, dict) else None
            if not isinstance(results, list):
                raise ClientError(Exit.UNREACHABLE, f"{self.url} answered a list without results.")
            for item in results:
                if limit is not None and given >= limit:
                    return
                given += 1
                yield item
            following = page.get("next")
            if not following or (limit is not None and given >= limit):
                return
            page = self._send("GET", self._same_origin(str(following)), params={}, body=None, headers={})

    def _same_origin(self, link: str) -> str:
        """A page link, only if it points back at this portal: the token goes nowhere else."""
        ours, theirs = urlsplit(self.url), urlsplit(link)
        if (theirs.scheme, theirs.netloc) != (ours.scheme, ours.netloc):
            raise ClientError(Exit.UNREACHABLE, f"{self.url} sent a page link to another address: {link}.")
        return link

    def _send(
        self,
        method: str,
        url: str,
        *,
        params: Mapping[str, str | int],
        body: Mapping[str, Any] | None,
        headers: Mapping[str, str],
    ) -> Any:
        try:
            response = self._client.request(
                method, url, params=dict(params) or None, json=dict(body) if body is not None else None,
                headers=headers,
            )  # fmt: skip
        except httpx.TimeoutException as exc:
            raise ClientError(Exit.UNREACHABLE, f"{self.url} did not answer in time ({exc}).") from exc
        except httpx.HTTPError as exc:  # connection refused, name not found, TLS, a broken answer
            raise ClientError(
                Exit.UNREACHABLE, f"Cannot reach {self.url}: {exc or type(exc).__name__}."
            ) from exc
        return self._answer(response)

    def _answer(self, response: httpx.Response) -> Any:
        try:
            body = response.json()
        except ValueError:
            body = None
        status = response.status_code
        if 200 <= status < 300 and body is not None:
            return body
        detail = str(body.get("detail", "")) if isinstance(body, dict) else ""
        if body is None or status >= 500 or 300 <= status < 400:
            what = "is not the gpushare API" if 200 <= status < 300 else f"answered {status}"
            raise ClientError(
                Exit.UNREACHABLE, f"{self.url} {what} ({response.request.method} {response.url.path})."
            )
        if status == 429:
            wait = response.headers.get("Retry-After", "")
            raise ClientError(
                Exit.RATE_LIMITED,
                f"Rate limited: {detail or 'too many requests'}"
                + (f" (retry after {wait} s)." if wait else ""),
            )
        if status == 400:
            fields = field_errors(body)
            raise ClientError(Exit.REFUSED, f"Refused: {describe_fields(fields)}", fields=fields)
        code = _STATUS_EXIT.get(status, Exit.REFUSED)
        message = detail or describe_fields(field_errors(body)) or f"the portal answered {status}"
        prefix = {Exit.AUTH: "Token refused", Exit.NOT_FOUND: "Not found", Exit.REFUSED: "Refused"}[code]
        raise ClientError(code, f"{prefix}: {message}")

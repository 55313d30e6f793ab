"""The Content-Security-Policy header, with WebSockets of the page's own host allowed.

CSP Level 3 browsers read ``connect-src 'self'`` as including ws:// and wss:// of the same
host; older ones (Safari before 15.4) do not, and the live charts, alerts and terminals
would fail there. The host is the request's, already checked against ALLOWED_HOSTS.
"""

from __future__ import annotations

from csp.middleware import CSPMiddleware, PolicyParts
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponseBase


class ContentSecurityPolicyMiddleware(CSPMiddleware):
    def get_policy_parts(
        self, request: HttpRequest, response: HttpResponseBase, report_only: bool = False
    ) -> PolicyParts:
        parts = super().get_policy_parts(request, response, report_only)
        if report_only:
            return parts
        try:
            host = request.get_host()
        except DisallowedHost:  # answered with a 400 that needs no WebSockets
            return parts
        socket = f"{'wss' if request.is_secure() else 'ws'}://{host}"
        update = dict(parts.update or {})
        connect = update.get("connect-src") or []
        update["connect-src"] = [*([connect] if isinstance(connect, str) else connect), socket]
        parts.update = update
        return parts

"""gpushare's command-line client: sandboxes, their shells, usage and invoices, over the
portal's REST API (``/api/v1/``, described at ``/api/schema/``) and its terminal WebSocket.

It imports no part of the portal: it is installed alone (``client/pyproject.toml``) on any
machine that can reach the portal, with httpx and websockets only.
"""

__version__ = "0.1.0"

"""The REST API's framework, shared by every app's ``api.py``: strict parsing of bodies and
query strings (``text``, ``parsers``, ``strict``), filters (``filters``), cursor pages
(``pagination``), the base view and documented error answers (``views``, ``errors``),
``Idempotency-Key`` (``idempotency`` and its model) and rate limits (``throttles``).

It imports no other portal app: the apps' viewsets build on it, and token authentication
stays with the tokens (``portal.accounts.authentication``)."""

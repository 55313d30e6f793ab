"""A real OpenID Connect provider for the single sign-on tests: a small Django project on
django-oidc-provider, run as its own server process (``tests/identity/servers.py``), with
its own users, groups and SQLite database."""

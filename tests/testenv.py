"""Test-process environment, loaded with ``-p tests.testenv`` so it runs before
pytest-django reads the settings (a conftest would be too late).

Tests run with production defaults (DEBUG off) and a throwaway key; everything else
comes from the environment (DATABASE_URL, REDIS_URL) as in ``make test``.
"""

import os

# Long and varied enough for production's start-up check (DEBUG is off in tests).
os.environ.setdefault("SECRET_KEY", "test-only-secret-key-not-for-production-0123456789abcdef")
# Test clients speak plain HTTP; test_security.py turns the redirect back on where it checks it.
os.environ.setdefault("SECURE_SSL_REDIRECT", "false")
os.environ.setdefault("SESSION_COOKIE_SECURE", "false")
os.environ.setdefault("CSRF_COOKIE_SECURE", "false")
os.environ.setdefault("ALLOWED_HOSTS", "localhost,127.0.0.1,testserver")
os.environ.setdefault("STATIC_MANIFEST", "false")
# Connections opened by consumer threads must close, or the test database cannot be dropped.
os.environ.setdefault("DB_CONN_MAX_AGE", "0")

"""The test identity provider's settings: everything from IDP_* variables the test sets."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = "test-identity-provider-only-" + "x" * 40
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "oidc_provider",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "tests.identity.idp.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {"context_processors": ["django.template.context_processors.request"]},
    }
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["IDP_DATABASE"]}}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = True
LOGIN_URL = "/accounts/login/"
SITE_URL = os.environ["IDP_URL"]  # the issuer
OIDC_USERINFO = "tests.identity.idp.claims.userinfo"
OIDC_EXTRA_SCOPE_CLAIMS = "tests.identity.idp.claims.GroupsScope"
# Browsers keep cookies per host, not per port: on 127.0.0.1 beside the portal, the same
# names would overwrite the portal's session (and the sign-in's state in it).
SESSION_COOKIE_NAME = "idp_sessionid"
CSRF_COOKIE_NAME = "idp_csrftoken"

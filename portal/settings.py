"""gpushare settings, all from the environment (see README "Configuration").

Unset variables fall back to the embedded mode: SQLite in ``var/``, an embedded Redis on a
unix socket, the simulated GPU backend when NVML finds no GPU.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import dj_database_url
from csp.constants import NONE, SELF, UNSAFE_INLINE

from portal.identity.config import authentication_backends, ldap_settings, oidc_settings
from portal.tunnels.app_origin import AppsDomain, AppsDomainError
from scheduler.placement import DEFAULT_POLICY, POLICY_NAMES
from wire import config as worker_config
from wire.env import ConfigError, env_bool, env_choice, env_int, env_list, env_networks, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = worker_config.var_dir()

DEBUG = env_bool("DEBUG", False)
# Development only: production refuses to start with it (or any weak key) below. Read in
# wire.config, where beat (which loads no settings) reads it too: the control plane's
# messages are signed with a key derived from it (wire/signing.py).
_DEV_SECRET = worker_config.DEV_SECRET
SECRET_KEY = worker_config.secret_key()
# Django's own bar for a key (the security.W009 deploy check), enforced at start-up: a weak key
# lets anyone forge sessions and password-reset links, which a warning nobody reads does not stop.
if not DEBUG and (
    SECRET_KEY == _DEV_SECRET
    or len(SECRET_KEY) < 50
    or len(set(SECRET_KEY)) < 5
    or SECRET_KEY.startswith("django-insecure-")
):
    raise ConfigError(
        "SECRET_KEY must be at least 50 random characters when DEBUG is false "
        "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(50))')"
    )
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

GPU_BACKEND = worker_config.gpu_backend_kind()
SANDBOX_DRIVER = worker_config.sandbox_driver_kind()
REDIS_URL = worker_config.redis_url()
EMBEDDED_REDIS_DIR = worker_config.embedded_redis_dir()

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "csp",
    "channels",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "portal.api",
    "portal.audit",
    "portal.accounts",
    "portal.identity",
    "portal.catalog",
    "portal.fleet",
    "portal.quotas",
    "portal.sandboxes",
    "portal.scheduling",
    "portal.notifications",
    "portal.tunnels",
    "portal.billing",
    "portal.webhooks",
    "portal.telemetry",
    "portal.console",
    "portal.twin",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "portal.overload.OverloadMiddleware",
    "portal.security.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "portal.audit.trail.AuditActorMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "portal.urls"
ASGI_APPLICATION = "portal.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "portal.sandboxes.context.notifications",
            ],
        },
    },
]


# PostgreSQL connections per process (web worker, Celery worker); 0: no pool, a connection
# per thread kept DB_CONN_MAX_AGE seconds (for PgBouncer). Every process's pool together must
# stay under the server's max_connections (100 by default).
DB_POOL_MAX_SIZE = env_int("DB_POOL_MAX_SIZE", 10, minimum=0)
DB_POOL_TIMEOUT_S = env_int("DB_POOL_TIMEOUT_S", 10, minimum=1)


def _database() -> dict[str, object]:
    url = env_str("DATABASE_URL", "")
    if url:
        try:
            db: dict[str, object] = dict(dj_database_url.parse(url))
        except ValueError as exc:
            raise ConfigError(f"DATABASE_URL is not a database URL: {exc}") from exc
        if db.get("ENGINE") == "django.db.backends.sqlite3":
            db["OPTIONS"] = _SQLITE_OPTIONS
        elif DB_POOL_MAX_SIZE:
            # Each process holds at most DB_POOL_MAX_SIZE connections, however many threads serve
            # its requests; a request that waits DB_POOL_TIMEOUT_S for one is answered 503 with
            # Retry-After (portal/overload.py) instead of PostgreSQL refusing the connection.
            # Django's pool lends a connection per request, so it wants CONN_MAX_AGE 0.
            # A pooled connection outlives a PostgreSQL restart broken: checked on each loan (an
            # empty round trip), a broken one is replaced instead of failing a request each.
            db["CONN_HEALTH_CHECKS"] = True
            db["OPTIONS"] = {
                "pool": {
                    "min_size": min(2, DB_POOL_MAX_SIZE),
                    "max_size": DB_POOL_MAX_SIZE,
                    "timeout": DB_POOL_TIMEOUT_S,
                }
            }
        else:  # behind PgBouncer (transaction pooling) or another pooler of the operator's
            db["CONN_MAX_AGE"] = env_int("DB_CONN_MAX_AGE", 60, minimum=0)
        return db
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": VAR_DIR / "gpushare.sqlite3",
        "OPTIONS": _SQLITE_OPTIONS,
        # A file, not :memory:, so worker processes in e2e tests see the test database.
        "TEST": {"NAME": VAR_DIR / "test-gpushare.sqlite3"},
    }


# Several processes write (web, control worker): WAL lets readers proceed, IMMEDIATE takes
# the write lock at BEGIN so two writers queue instead of failing mid-transaction.
_SQLITE_OPTIONS = {
    "transaction_mode": "IMMEDIATE",
    "timeout": 20,
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}

DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Argon2 first, as Django's documentation recommends: memory-hard (a GPU farm guesses it far
# slower), and at Django's settings a sign-in's check took 121 ms here (205 ms of CPU, its
# lanes in parallel) against 298 ms for PBKDF2's 1,000,000 rounds, which queued sign-ins
# behind each other under load (POST /login/ p99 1.1 s with 100 users). The others still
# verify older hashes, which Django rewrites as Argon2 at their next sign-in.
PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.Argon2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2SHA1PasswordHasher",
    "django.contrib.auth.hashers.ScryptPasswordHasher",
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Password reset mails (Django's views): SMTP when EMAIL_HOST is set, else the console
# backend, which writes each mail to the web process's output (make run's terminal).
EMAIL_HOST = env_str("EMAIL_HOST", "")
EMAIL_BACKEND = (
    "django.core.mail.backends.smtp.EmailBackend"
    if EMAIL_HOST
    else "django.core.mail.backends.console.EmailBackend"
)
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10, minimum=1)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "gpushare <noreply@localhost>")
if EMAIL_USE_TLS and EMAIL_USE_SSL:
    raise ConfigError(
        "EMAIL_USE_TLS and EMAIL_USE_SSL are both set: STARTTLS or TLS from the start, not both"
    )
PASSWORD_RESET_TIMEOUT = env_int("PASSWORD_RESET_TIMEOUT", 3 * 3600, minimum=300)
# The portal's address as its users open it (scheme, host, optional path prefix): links in
# the mails the workers send (notification emails), which have no request to take it from,
# and in password-reset mails, whose request's Host header is the asker's to choose.
PORTAL_URL = env_str("PORTAL_URL", "http://localhost:8000").rstrip("/")
if not PORTAL_URL.startswith(("http://", "https://")):
    raise ConfigError(f"PORTAL_URL must start with http:// or https://, not {PORTAL_URL!r}")
# Sandboxes' web apps, each on an origin of its own, <sandbox>-<key>.APPS_DOMAIN, never the
# portal's (portal/tunnels/app_origin.py; wildcard DNS and certificate: deploy/README.md).
# Unset in production: no app is served. make run's default: browsers resolve *.localhost
# to loopback themselves.
try:
    APPS = AppsDomain.parse(env_str("APPS_DOMAIN", "apps.localhost" if DEBUG else ""), PORTAL_URL)
except AppsDomainError as exc:
    raise ConfigError(str(exc)) from exc
# How long a grant the portal hands the browser may wait to be redeemed on the app's origin
# (once), and how long the app session it buys lasts (while the portal session does).
APP_GRANT_TTL_S = 60
APP_SESSION_TTL_S = env_int("APP_SESSION_TTL_S", 12 * 3600, minimum=300)

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "sandbox-list"
LOGOUT_REDIRECT_URL = "login"

# Single sign-on (portal/identity, README "Single sign-on"): OpenID Connect when
# OIDC_RP_CLIENT_ID is set, LDAP when LDAP_SERVER_URI is set; group rules (the console's
# catalog) map the provider's groups to projects at each sign-in. Local accounts keep working:
# LOCAL_SIGN_IN=staff leaves them to admins only.
_oidc, _ldap = oidc_settings(), ldap_settings()
OIDC_ENABLED: bool = _oidc.pop("OIDC_ENABLED")
OIDC_GROUPS_CLAIM: str = _oidc.pop("OIDC_GROUPS_CLAIM", "groups")
OIDC_PROVIDER_NAME: str = _oidc.pop("OIDC_PROVIDER_NAME", "")
LDAP_ENABLED: bool = _ldap.pop("LDAP_ENABLED")
globals().update(_oidc)  # mozilla-django-oidc's and django-auth-ldap's own names
globals().update(_ldap)
LOCAL_SIGN_IN = env_choice("LOCAL_SIGN_IN", ("everyone", "staff"), "everyone")
AUTHENTICATION_BACKENDS = authentication_backends(OIDC_ENABLED, LDAP_ENABLED, LOCAL_SIGN_IN)

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]
# Hashed, compressed names need ``collectstatic`` (a deploy step); without it (DEBUG, tests)
# files are served straight from static/ by WhiteNoise's finders.
STATIC_MANIFEST = env_bool("STATIC_MANIFEST", not DEBUG)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if STATIC_MANIFEST
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
WHITENOISE_USE_FINDERS = not STATIC_MANIFEST
if not STATIC_MANIFEST:
    # WhiteNoise also serves STATIC_ROOT and warns on every start while it is missing.
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": worker_config.CHANNEL_LAYER_BACKEND,
        "CONFIG": {
            "hosts": [REDIS_URL],
            **worker_config.CHANNEL_LAYER_OPTIONS,
        },
    }
}

CELERY_BROKER_URL = worker_config.celery_broker_url(REDIS_URL)

# Django's cache is Redis, shared by every ASGI server: API rate limits count across them.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "gpushare",
        # One pool per process, not a connection per request (see portal/cache_pool.py).
        "OPTIONS": {"pool_class": "portal.cache_pool.SharedConnectionPool"},
    }
}

# Sessions are read on every request and by every open socket's re-check: from the cache, with
# the database behind it (sign-outs and expiry as before).
SESSION_ENGINE = "django.contrib.sessions.backends.cached_db"


def _api_rate(name: str, default: str) -> str:
    """A DRF rate such as "600/min"; a typo fails at start, not on the first API call."""
    value = env_str(name, default)
    count, _, period = value.partition("/")
    if not count.isdigit() or period[:1] not in ("s", "m", "h", "d"):
        raise ConfigError(f"{name} must look like 600/min or 10000/hour, not {value!r}")
    return value


REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.accounts.authentication.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": [
        "rest_framework.permissions.IsAuthenticated",
        "portal.accounts.permissions.TokenScopes",
    ],
    "DEFAULT_THROTTLE_CLASSES": [
        "portal.api.throttles.BurstRate",
        "portal.api.throttles.SustainedRate",
    ],
    # Per token (or per signed-in user): a short burst, and a sustained hourly budget.
    "DEFAULT_THROTTLE_RATES": {
        "burst": _api_rate("API_RATE_BURST", "600/min"),
        "sustained": _api_rate("API_RATE_SUSTAINED", "10000/hour"),
    },
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "portal.api.pagination.CheckedPageSize",
    # Anonymous rate limits key on the socket's address (already the client's behind a
    # trusted proxy): DRF would otherwise key on X-Forwarded-For as the client sent it.
    "NUM_PROXIES": 0,
    # Every route parses JSON strictly (duplicate keys, NaN, lone surrogates, deep nesting).
    "DEFAULT_PARSER_CLASSES": [
        "portal.api.parsers.StrictJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "PAGE_SIZE": 100,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "gpushare API",
    "DESCRIPTION": (
        "Self-service sandboxes, usage, invoices, prices, projects and quotas.\n\n"
        "Authenticate with `Authorization: Bearer gps_...` (an API token; its scopes: `read:usage` "
        "for every GET, `write:sandboxes` for sandbox POSTs, `admin` for everything) or, in the "
        "browser, with your session (and its CSRF token). Lists use cursor pages: follow `next`. "
        "Send an `Idempotency-Key` header with every POST. Rate limited per token: 429 with "
        '`Retry-After`. A 400 names each field at fault: `{"field": ["message"]}`. Money is in '
        "micro-units (1/1,000,000) of the currency beside it."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "SandboxStateEnum": "portal.sandboxes.models.SandboxState",
        "InvoiceStateEnum": "portal.billing.models.InvoiceState",
    },
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# An open WebSocket asks again whether its user may still watch (or type) every this many
# seconds, and closes once the answer is no (portal/accounts/streams.py).
STREAM_RECHECK_S = env_int("STREAM_RECHECK_S", 5, minimum=1)
# What the portal keeps of one batch sandbox's output (the newest bytes; the page, the
# download and the API read it). Agents keep SANDBOX_OUTPUT_MAX_BYTES on the host.
BATCH_OUTPUT_MAX_BYTES = env_int("BATCH_OUTPUT_MAX_BYTES", 10 * 2**20, minimum=65536)
# Seconds without an agent heartbeat before /healthz calls it stale (3 missed beats).
AGENT_HEARTBEAT_S = env_int("AGENT_HEARTBEAT_S", 5, minimum=1)
CYCLE_INTERVAL_S = env_int("CYCLE_INTERVAL_S", 2, minimum=1)
# A queue head gets a reservation (later requests keep off its devices unless known to end
# first) only if it could start within this many seconds (Slurm's bf_window, 1 day).
BACKFILL_WINDOW_S = env_int("BACKFILL_WINDOW_S", 86_400, minimum=0)
# Placement policy of the live scheduling cycle: gpushare (fragmentation-aware, learns the
# workload; what the trace benchmarks measure) or first-fit (a plain baseline).
SCHEDULER_POLICY = env_choice("SCHEDULER_POLICY", POLICY_NAMES, DEFAULT_POLICY)
# An MPS GPU takes only shares of one size (its first share's memory and threads), as
# NVIDIA's device plugin does: the MPS server's limits bind each client process and the
# largest share's are its ceiling, so beside a larger share a small share's process can take
# the larger one's memory until the agent's memory watch stops it. Off by default: shares of
# any size pack onto a GPU, which is what keeps fractional GPUs from fragmenting (the openb
# replays: 3.8 % of GPUs unallocated at arrived 100 % with it off, 10.2 % on).
MPS_ONE_SIZE_PER_GPU = env_bool("MPS_ONE_SIZE_PER_GPU", False)
# Half-life of past usage in the fair-share order (hours).
FAIRSHARE_HALF_LIFE_H = env_int("FAIRSHARE_HALF_LIFE_H", 168, minimum=1)
# MIG re-layout on its own, for a queued MIG request no free instance fits: at most this
# many running sandboxes may be stopped and relaunched for it (0: only idle instances are
# reshaped; -1: never on its own, only when an admin asks from the console).
MIG_AUTO_RELAYOUT_MAX_DISTURBED = env_int("MIG_AUTO_RELAYOUT_MAX_DISTURBED", 0, minimum=-1)
# A fleet plan whose agents have not reported within this many seconds is given up.
FLEET_PLAN_TIMEOUT_S = env_int("FLEET_PLAN_TIMEOUT_S", 900, minimum=30)
# One-minute telemetry rollups older than this are deleted (the charts' longest history).
TELEMETRY_RETENTION_DAYS = env_int("TELEMETRY_RETENTION_DAYS", 30, minimum=1)
# A month's invoice drafts are finalized this many days after it ends (late usage reports
# land first); drafts of open months are refreshed at most this often.
INVOICE_FINALIZE_AFTER_DAYS = env_int("INVOICE_FINALIZE_AFTER_DAYS", 3, minimum=0)
INVOICE_DRAFT_REFRESH_SECONDS = env_int("INVOICE_DRAFT_REFRESH_SECONDS", 600, minimum=30)
# Webhooks (portal.webhooks; Django admin, *Webhook endpoints*) are signed the Standard
# Webhooks way, each endpoint with its own whsec_ secret. "Rotate secret" in the admin gives
# an endpoint a new one and keeps signing with the old one as well for this many hours, so
# its receiver can switch over (0: the old secret stops at once).
WEBHOOK_SECRET_GRACE_HOURS = env_int("WEBHOOK_SECRET_GRACE_HOURS", 24, minimum=0)
# Webhooks go to public addresses only: an endpoint on loopback, a private or link-local
# network (the cloud metadata service at 169.254.169.254), unique-local, multicast or
# unspecified addresses is refused when saved and again at each delivery, for the address
# actually connected to. These networks (CIDR, comma-separated) are let through: a receiver
# on the operator's own network. Empty: none.
WEBHOOK_ALLOWED_NETWORKS = env_networks("WEBHOOK_ALLOWED_NETWORKS")
# Alert webhooks were once a URL on the alert policy signed with this one global secret.
# It is read only by the migration that turns those URLs into webhook endpoints (telemetry
# 0004, run once on upgrade): their secret is this key as whsec_<base64> (the same key
# bytes, so receivers keep it; unset: a new random secret). Afterwards alert webhooks are
# endpoints subscribed to alert.raised / alert.cleared, their secrets rotated in the admin,
# and this setting changes nothing.
ALERT_WEBHOOK_SECRET = env_str("ALERT_WEBHOOK_SECRET", "")
# Bearer token Prometheus scrapes /metrics with (METRICS_TOKEN_FILE: read from a file);
# unset, only staff sessions may read /metrics.
METRICS_TOKEN = env_str("METRICS_TOKEN", "")

# --- HTTPS, cookies and headers (README "Security"). Production assumes TLS at a reverse
# proxy in TRUSTED_PROXIES that sets X-Forwarded-Proto: portal.asgi turns it into the
# request's scheme (no SECURE_PROXY_SSL_HEADER: Django would believe it from anyone).
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
# Probes and Prometheus scrape from inside the network over plain HTTP; a redirect to https
# would break them (/metrics still wants its bearer token).
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 365 * 24 * 3600, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
# Preloading binds the whole domain to HTTPS in browsers for months and needs the operator to
# submit it to hstspreload.org: their decision, so off unless asked for (and its deploy
# warning, W021, silenced below).
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
# Over HTTPS the portal's cookies carry the __Host- prefix: the browser then refuses any such
# cookie set with a Domain, so an app on a sibling origin (apps.gpus.example.org beside
# gpus.example.org: the same site) cannot plant a session or CSRF cookie on the portal with
# document.cookie. (Renaming them signs everyone out once, at the upgrade.)
SESSION_COOKIE_NAME = f"{'__Host-' if SESSION_COOKIE_SECURE else ''}sessionid"
CSRF_COOKIE_NAME = f"{'__Host-' if CSRF_COOKIE_SECURE else ''}csrftoken"
DEVICE_COOKIE_NAME = f"{'__Host-' if SESSION_COOKIE_SECURE else ''}gpushare_device"  # sign-in throttle
if APPS is not None and (_overlap := APPS.overlaps(ALLOWED_HOSTS, CSRF_TRUSTED_ORIGINS)):
    raise ConfigError(f"APPS_DOMAIN {APPS.domain}: {_overlap}; apps must never be the portal's origin")
SILENCED_SYSTEM_CHECKS = [] if SECURE_HSTS_PRELOAD else ["security.W021"]

# Content-Security-Policy (django-csp; portal.security adds ws(s):// of the request's host to
# connect-src, which older browsers do not read into 'self'). No inline scripts anywhere:
# templates load static/dist/app.js only. Styles allow 'unsafe-inline' because templates size
# bars and MIG slices with style="" and htmx, xterm and Swagger UI inject <style> elements.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF],
        "style-src": [SELF, UNSAFE_INLINE],
        "img-src": [SELF, "data:"],  # Swagger UI's icons are data: SVGs
        "font-src": [SELF],
        "connect-src": [SELF],
        "object-src": [NONE],
        "base-uri": [SELF],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    },
}

# --- Login throttling (portal.accounts.throttle): failures counted in a window of
# LOGIN_LOCKOUT_SECONDS per browser that signed in as the user before (device cookie), else per
# (username, address), per address, and per username from untrusted browsers; at a limit the
# login answers 429 without checking the password until the window ends. Invalid API tokens
# count per address.
LOGIN_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5, minimum=1)
LOGIN_IP_FAILURE_LIMIT = env_int("LOGIN_IP_FAILURE_LIMIT", 50, minimum=1)
LOGIN_USERNAME_FAILURE_LIMIT = env_int("LOGIN_USERNAME_FAILURE_LIMIT", 100, minimum=1)
# Password reset mails one client address may ask for in the window.
PASSWORD_RESET_LIMIT = env_int("PASSWORD_RESET_LIMIT", 5, minimum=1)
LOGIN_LOCKOUT_SECONDS = env_int("LOGIN_LOCKOUT_SECONDS", 900, minimum=1)
# The reverse proxies whose X-Forwarded-For and X-Forwarded-Proto are believed (addresses or
# networks, e.g. 127.0.0.1 for nginx on the same machine): portal.asgi takes the client's
# address and https from them; from anyone else, those headers are ignored. Unset: none.
TRUSTED_PROXIES = env_list("TRUSTED_PROXIES", [])

LOG_LEVEL = env_choice("LOG_LEVEL", ("debug", "info", "warning", "error", "critical"), "info").upper()
_TRANSITIONS_LEVEL = LOG_LEVEL if LOG_LEVEL in ("DEBUG", "ERROR", "CRITICAL") else "INFO"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    # One line per sandbox transition (portal.sandboxes.transitions) whatever the level, unless
    # only errors are wanted: what an operator follows in `make run`'s terminal.
    "loggers": {
        "portal.sandboxes.transitions": {"level": _TRANSITIONS_LEVEL},
        # Django's default config gives "django" a handler of its own when DEBUG: every
        # request warning would print twice, once bare.
        "django": {"handlers": [], "propagate": True},
    },
}
# Under ASGI, WhiteNoise's file responses (DEBUG serving from static/) are synchronous
# iterators; Django warns once per process that it consumes them for the async server.
warnings.filterwarnings("ignore", message="StreamingHttpResponse must consume synchronous iterators")

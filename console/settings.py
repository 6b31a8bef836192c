"""Django settings for the pdbridge console, driven by environment variables (12-factor).

Every variable is read once here, validated, and documented in docs/configuration.md. A bad
value stops start-up with ``ImproperlyConfigured`` naming the variable.

``PDBRIDGE_ENV`` selects defaults:

* ``embedded`` (default): SQLite under ``var/``, a broker that needs no server, a secret key
  generated once into ``var/secret-key``; meant for one machine.
* ``production``: ``SECRET_KEY``, ``DATABASE_URL`` and ``ALLOWED_HOSTS`` are required.
* ``test``: like embedded, but never writes a key file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from kombu.transport import TRANSPORT_ALIASES

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("PDBRIDGE_VAR_DIR", BASE_DIR / "var"))

PDBRIDGE_ENV = os.environ.get("PDBRIDGE_ENV", "embedded")
if PDBRIDGE_ENV not in {"embedded", "production", "test"}:
    raise ImproperlyConfigured(
        f"PDBRIDGE_ENV: must be one of embedded, production, test (got {PDBRIDGE_ENV!r})"
    )
PRODUCTION = PDBRIDGE_ENV == "production"


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}: expected a boolean (true/false), got {raw!r}")


def _env_int(name: str, default: int, *, minimum: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}: expected an integer, got {raw!r}") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name}: must be >= {minimum}, got {value}")
    return value


def _env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def _required(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise ImproperlyConfigured(f"{name}: required when PDBRIDGE_ENV=production")
    return value


def _secret_key() -> str:
    if PRODUCTION:
        return _required("SECRET_KEY")
    if os.environ.get("SECRET_KEY"):
        return os.environ["SECRET_KEY"]
    if PDBRIDGE_ENV == "test":
        return "test-only-" + "x" * 40
    key_file = VAR_DIR / "secret-key"
    if not key_file.exists():
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        key_file.write_text(secrets.token_urlsafe(50))
        key_file.chmod(0o600)
    return key_file.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = _env_bool("DEBUG", False)
ALLOWED_HOSTS = (
    _env_list("ALLOWED_HOSTS", [])
    if PRODUCTION
    else _env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
)
if PRODUCTION and not ALLOWED_HOSTS:
    raise ImproperlyConfigured("ALLOWED_HOSTS: required when PDBRIDGE_ENV=production")
CSRF_TRUSTED_ORIGINS = _env_list("CSRF_TRUSTED_ORIGINS", [])
for _origin in CSRF_TRUSTED_ORIGINS:
    # Django only checks this later (system check 4_0), naming the setting, not the variable.
    if "://" not in _origin:
        raise ImproperlyConfigured(
            f"CSRF_TRUSTED_ORIGINS: {_origin!r} needs a scheme (https://console.example)"
        )

_database_url = (
    _required("DATABASE_URL")
    if PRODUCTION
    else os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'pdbridge.sqlite3'}"
)
try:
    DATABASES = {"default": dj_database_url.parse(_database_url, conn_max_age=60)}
except (ValueError, KeyError) as exc:
    raise ImproperlyConfigured(f"DATABASE_URL: cannot parse ({exc})") from None
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    _name = str(DATABASES["default"]["NAME"] or "")
    if _name and _name != ":memory:" and not _name.startswith("file:"):
        _sqlite = Path(_name)
        _sqlite.parent.mkdir(parents=True, exist_ok=True)
        # The embedded database holds users' password hashes, audit and API tokens: readable
        # by its owner only (SQLite gives its journal and WAL files the database's mode).
        os.close(os.open(_sqlite, os.O_CREAT | os.O_RDWR, 0o600))
        _sqlite.chmod(0o600)
    # Several processes (console, worker, beat) share the embedded database.
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE"}
    DATABASES["default"]["CONN_MAX_AGE"] = 0

REDIS_URL = os.environ.get("REDIS_URL", "")
if REDIS_URL and not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    raise ImproperlyConfigured(
        f"REDIS_URL: expected redis://, rediss:// or unix://, got {REDIS_URL!r}"
    )

# Celery: Redis in production; the embedded default uses kombu's filesystem transport, which
# needs no server (see docs/configuration.md).
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or (REDIS_URL or "filesystem://")
# kombu's own filesystem transport can hand a consumer a half-written message (the worker dies
# on it); orchestrator.fsbroker writes each message whole, then renames it into place.
TRANSPORT_ALIASES["filesystem"] = "orchestrator.fsbroker:Transport"


def _url_scheme(url: str) -> str:
    """``redis`` of ``redis://h``; ``db`` of ``db+postgresql://h`` (Celery's prefix form)."""
    return url.split("://", 1)[0].split("+", 1)[0] if "://" in url else ""


# Celery would only fail on a bad URL when a task is first sent, far from the cause; it also
# accepts several broker URLs separated by ';' (failover).
for _url in CELERY_BROKER_URL.split(";"):
    if _url_scheme(_url.strip()) not in TRANSPORT_ALIASES:
        raise ImproperlyConfigured(
            f"CELERY_BROKER_URL: {_url.strip()!r} is not a broker URL kombu knows "
            "(redis://, rediss://, amqp://, filesystem://, ...)"
        )
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
if CELERY_BROKER_URL == "filesystem://":
    _broker_dir = VAR_DIR / "celery" / "broker"
    _broker_dir.mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        "processed_folder": str(_broker_dir),
        # Exchange tables; kombu's default is ./control relative to the working directory.
        "control_folder": str(VAR_DIR / "celery" / "control"),
        "store_processed": False,
    }
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND") or (REDIS_URL or None)
if CELERY_RESULT_BACKEND:
    from celery.app.backends import BACKEND_ALIASES

    if (_url_scheme(CELERY_RESULT_BACKEND) or CELERY_RESULT_BACKEND) not in BACKEND_ALIASES:
        raise ImproperlyConfigured(
            f"CELERY_RESULT_BACKEND: {CELERY_RESULT_BACKEND!r} is not a result backend Celery "
            "knows (redis://, rpc://, db+postgresql://, ...)"
        )
CELERY_TASK_ALWAYS_EAGER = False
# The console sends tasks by name (console/core/celery_client.py) to the same default queue
# the workers consume (orchestrator/queues.py).
CELERY_TASK_DEFAULT_QUEUE = "pdbridge"
# A step whose worker has not refreshed its heartbeat for this long is taken to have lost its
# worker and is resumed by the next advance (the beat job resume_stalled sends one).
PDBRIDGE_STEP_STALE_S = _env_int("PDBRIDGE_STEP_STALE_S", 60, minimum=1)

# The orchestrator's identity towards node agents (mTLS): a certificate whose name is in the
# agents' tls.allowed_identities, and the CA that signed the agents' certificates. Plaintext
# only with PDBRIDGE_CONTROLLER_INSECURE=true (the embedded testbed on loopback).
PDBRIDGE_CONTROLLER_TLS_CA = os.environ.get("PDBRIDGE_CONTROLLER_TLS_CA", "")
PDBRIDGE_CONTROLLER_TLS_CERT = os.environ.get("PDBRIDGE_CONTROLLER_TLS_CERT", "")
PDBRIDGE_CONTROLLER_TLS_KEY = os.environ.get("PDBRIDGE_CONTROLLER_TLS_KEY", "")
PDBRIDGE_CONTROLLER_INSECURE = _env_bool("PDBRIDGE_CONTROLLER_INSECURE", False)
if PDBRIDGE_CONTROLLER_INSECURE and PRODUCTION:
    raise ImproperlyConfigured(
        "PDBRIDGE_CONTROLLER_INSECURE: plaintext agent calls are refused when PDBRIDGE_ENV=production"
    )

# Heartbeats: agents beat every HEARTBEAT_INTERVAL_S; a node that misses
# HEARTBEAT_MISSED_LIMIT beats in a row becomes "lost" (degraded after one missed beat).
HEARTBEAT_INTERVAL_S = _env_int("PDBRIDGE_HEARTBEAT_INTERVAL_S", 10, minimum=1)
HEARTBEAT_MISSED_LIMIT = _env_int("PDBRIDGE_HEARTBEAT_MISSED_LIMIT", 3, minimum=1)
# A console that cannot hear heartbeats does not blame the nodes (console.inventory.liveness):
# the liveness loop probes the console's own listener (LIVENESS_PROBE_URL + /healthz, the URL
# the agents beat to, verified with LIVENESS_PROBE_CA) and judges nobody while it fails, nor
# while the loop itself was not running; a node silent across such an outage has
# HEARTBEAT_OUTAGE_GRACE_S after it to beat again (at least the agents' console.backoff_max_s
# + console.timeout_s + one interval: the default 90 covers the agents' 60 + 5 + 10).
HEARTBEAT_OUTAGE_GRACE_S = _env_int("PDBRIDGE_HEARTBEAT_OUTAGE_GRACE_S", 90, minimum=0)
LIVENESS_PROBE_URL = os.environ.get("PDBRIDGE_LIVENESS_PROBE_URL", "").rstrip("/")
if LIVENESS_PROBE_URL and not LIVENESS_PROBE_URL.startswith(("http://", "https://")):
    raise ImproperlyConfigured(
        f"PDBRIDGE_LIVENESS_PROBE_URL: an http(s) URL, got {LIVENESS_PROBE_URL!r}"
    )
LIVENESS_PROBE_CA = os.environ.get("PDBRIDGE_LIVENESS_PROBE_CA", "")
LIVENESS_PROBE_TIMEOUT_S = _env_int("PDBRIDGE_LIVENESS_PROBE_TIMEOUT_S", 5, minimum=1)

# Telemetry samples older than this are deleted by the hourly beat job prune_samples.
TELEMETRY_RETENTION_DAYS = _env_int("PDBRIDGE_TELEMETRY_RETENTION_DAYS", 14, minimum=1)

# Link telemetry (orchestrator.linkops): the probe-links beat job's period (the admin can
# change the schedule; staleness is judged against this) and each probe's length in seconds.
LINK_PROBE_S = _env_int("PDBRIDGE_LINK_PROBE_S", 300, minimum=10)
LINK_PROBE_SECONDS = _env_int("PDBRIDGE_LINK_PROBE_SECONDS", 1, minimum=1)

# Tidal scale-down (orchestrator.tidalops): the longest the job waits, after draining a node,
# for every gateway to apply the drain and end its legs to it before stopping the engine
# anyway (0: do not wait).
TIDAL_DRAIN_TIMEOUT_S = _env_int("PDBRIDGE_TIDAL_DRAIN_TIMEOUT_S", 120, minimum=0)

# Alert e-mail goes through Django's SMTP backend (tests use the in-memory backend).
EMAIL_HOST = os.environ.get("PDBRIDGE_EMAIL_HOST", "localhost")
EMAIL_PORT = _env_int("PDBRIDGE_EMAIL_PORT", 25, minimum=1)
EMAIL_USE_TLS = _env_bool("PDBRIDGE_EMAIL_USE_TLS", False)
DEFAULT_FROM_EMAIL = os.environ.get("PDBRIDGE_EMAIL_FROM", "pdbridge@localhost")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "console.core",
    "console.runs",
    "console.telemetry",
    "console.inventory",
    "console.catalog",
    "console.deployments",
    "console.rollouts",
    "console.planner",
    "console.schedules",
    "console.alerts",
    "console.drills",
    "console.gatewaykeys",
]

MIDDLEWARE = [
    "console.core.metrics.MetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "console.core.middleware.RequestIdMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "console.urls"
WSGI_APPLICATION = "console.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "console" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.core.context_processors.roles",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "login"

SESSION_COOKIE_SECURE = _env_bool("SESSION_COOKIE_SECURE", PRODUCTION)
CSRF_COOKIE_SECURE = _env_bool("CSRF_COOKIE_SECURE", PRODUCTION)
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if PRODUCTION else None

REST_FRAMEWORK = {
    # Token first, so that an anonymous API call gets 401 with WWW-Authenticate. User API
    # tokens are stored hashed (console.core.authentication; DRF's authtoken app kept them in
    # plaintext and is no longer installed).
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "console.core.authentication.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["console.core.permissions.RolePermission"],
    "DEFAULT_PAGINATION_CLASS": "console.core.api.pagination.StandardPagination",
    # A bad filter, ordering or page value is a 400 naming it, never ignored (docs/api.md).
    "DEFAULT_FILTER_BACKENDS": [
        "console.core.api.filters.StrictFilterBackend",
        "console.core.api.filters.StrictOrderingFilter",
        "console.core.api.filters.StrictSearchFilter",
    ],
    # Every operation documents its 400/401/403/404/409 answers (console/core/api/schema.py).
    "DEFAULT_SCHEMA_CLASS": "console.core.api.schema.ConsoleAutoSchema",
    "EXCEPTION_HANDLER": "console.core.api.exceptions.exception_handler",
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "pdbridge API",
    "DESCRIPTION": "Cross-datacenter prefill/decode operations: inventory, models, deployments, "
    "rollout plans, runs, drills, schedules and the capacity planner.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "SiteRoleEnum": "console.inventory.choices.SiteRole",
        "PoolRoleEnum": "console.deployments.choices.PoolRole",
        "UserRoleEnum": "console.core.choices.Role",
        "AlertLevelEnum": "console.alerts.choices.AlertLevel",
        "AlertLayerEnum": "console.alerts.choices.AlertLayer",
        "DrillKindEnum": "console.drills.choices.DrillKind",
        "DrillReportStateEnum": "console.drills.choices.ReportState",
        # Deployment and DeploymentEdited (the answer to an edit) share it.
        "DeploymentStateEnum": "console.deployments.choices.DeploymentState",
    },
}

LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO").upper()
if LOG_LEVEL not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
    raise ImproperlyConfigured(
        f"LOG_LEVEL: expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {LOG_LEVEL!r}"
    )

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {"django.db.backends": {"level": "INFO"}},
}

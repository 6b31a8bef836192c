"""Settings for the test run: the console's settings with the database the run chose."""

import os

from tests.services import database_url

os.environ["PDBRIDGE_ENV"] = "test"
os.environ["DATABASE_URL"] = database_url()

from console.settings import *  # noqa: F403

# Hashing cost is irrelevant in tests and dominates user-heavy test time otherwise.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# Serve static files straight from the apps (no collectstatic in tests).
WHITENOISE_AUTOREFRESH = True

# The test run's Celery broker: Redis when reachable (a database of its own), else the
# filesystem transport in a temporary folder (worker tests then use that).
from tests.services import redis_url as _redis_url  # noqa: E402

_redis = _redis_url()
if _redis:
    CELERY_BROKER_URL = _redis
    CELERY_BROKER_TRANSPORT_OPTIONS = {}
    CELERY_RESULT_BACKEND = None
# Worker processes started by tests share the test database, which must therefore be a file
# (SQLite) or a server (Postgres), never SQLite's in-memory database.
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):  # noqa: F405
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-{os.getpid()}.sqlite3")}  # noqa: F405

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

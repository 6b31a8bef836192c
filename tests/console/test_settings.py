"""Start-up validation: a bad variable stops the console with its name in the error."""

import os
import subprocess
import sys

import pytest


def _import_settings(**env):
    full = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "SECRET_KEY", "ALLOWED_HOSTS"}
    }
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", "import console.settings"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"PDBRIDGE_ENV": "production"}, "SECRET_KEY"),
        ({"PDBRIDGE_ENV": "production", "SECRET_KEY": "k" * 50}, "ALLOWED_HOSTS"),
        (
            {"PDBRIDGE_ENV": "production", "SECRET_KEY": "k" * 50, "ALLOWED_HOSTS": "c.example"},
            "DATABASE_URL",
        ),
        ({"PDBRIDGE_ENV": "staging"}, "PDBRIDGE_ENV"),
        ({"PDBRIDGE_ENV": "test", "DEBUG": "maybe"}, "DEBUG"),
        ({"PDBRIDGE_ENV": "test", "DATABASE_URL": "nosuchdb://x"}, "DATABASE_URL"),
        ({"PDBRIDGE_ENV": "test", "REDIS_URL": "http://x"}, "REDIS_URL"),
        (
            {"PDBRIDGE_ENV": "test", "PDBRIDGE_HEARTBEAT_MISSED_LIMIT": "0"},
            "PDBRIDGE_HEARTBEAT_MISSED_LIMIT",
        ),
        ({"PDBRIDGE_ENV": "test", "CELERY_BROKER_URL": "nosuchbroker://x"}, "CELERY_BROKER_URL"),
        ({"PDBRIDGE_ENV": "test", "CELERY_BROKER_URL": "localhost:6379"}, "CELERY_BROKER_URL"),
        (
            {"PDBRIDGE_ENV": "test", "CELERY_BROKER_URL": "redis://a;bogus://b"},
            "CELERY_BROKER_URL",
        ),
        ({"PDBRIDGE_ENV": "test", "CELERY_RESULT_BACKEND": "nosuch://x"}, "CELERY_RESULT_BACKEND"),
        ({"PDBRIDGE_ENV": "test", "LOG_LEVEL": "LOUD"}, "LOG_LEVEL"),
        (
            {"PDBRIDGE_ENV": "test", "CSRF_TRUSTED_ORIGINS": "console.example"},
            "CSRF_TRUSTED_ORIGINS",
        ),
    ],
)
def test_bad_environment_names_the_variable(env, variable):
    result = _import_settings(**env)

    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert f"{variable}:" in result.stderr


@pytest.mark.parametrize(
    "env",
    [
        {"CELERY_BROKER_URL": "redis://h:6379/0;redis://h2:6379/0"},
        {"CELERY_BROKER_URL": "amqp://guest@h//", "CELERY_RESULT_BACKEND": "rpc://"},
        {"CELERY_RESULT_BACKEND": "db+postgresql://u@h/db"},
        {"LOG_LEVEL": "debug", "CSRF_TRUSTED_ORIGINS": "https://console.example"},
    ],
)
def test_valid_celery_logging_and_origin_values_start(env):
    result = _import_settings(PDBRIDGE_ENV="test", **env)

    assert result.returncode == 0, result.stderr


def test_production_settings_accept_a_complete_environment():
    result = _import_settings(
        PDBRIDGE_ENV="production",
        SECRET_KEY="k" * 50,
        DATABASE_URL="postgres://u@h/db",
        ALLOWED_HOSTS="console.example",
    )

    assert result.returncode == 0, result.stderr


def test_the_embedded_database_file_is_readable_by_its_owner_only(tmp_path):
    """It holds password hashes, the audit log and API tokens: mode 0600, created so and
    tightened when an older run left it wider."""
    db = tmp_path / "pdbridge.sqlite3"
    url = f"sqlite:///{db}"
    assert _import_settings(PDBRIDGE_ENV="test", DATABASE_URL=url).returncode == 0
    assert db.stat().st_mode & 0o777 == 0o600
    db.chmod(0o644)
    assert _import_settings(PDBRIDGE_ENV="test", DATABASE_URL=url).returncode == 0
    assert db.stat().st_mode & 0o777 == 0o600

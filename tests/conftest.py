from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from tests import services
from tests.support import unavailable


def pytest_report_header(config: pytest.Config) -> list[str]:
    engine = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
    redis = services.redis_url() or "none (tests that need Redis are skipped)"
    return [f"pdbridge: database={engine} redis={redis} CI={services.IN_CI}"]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped and services.IN_CI:
        terminalreporter.write_line(
            f"CI=true: {len(skipped)} test(s) skipped; CI allows no skips.", red=True
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if (
        services.IN_CI
        and reporter is not None
        and reporter.stats.get("skipped")
        and exitstatus == 0
    ):
        session.exitstatus = 1


@pytest.fixture
def redis_url() -> str:
    url = services.redis_url()
    if url is None:
        unavailable("no Redis server reachable")
    return url


@pytest.fixture
def make_user(db: Any) -> Callable[..., Any]:
    """Create a user holding ``role`` (viewer / operator / admin, or None for no role)."""
    from django.contrib.auth import get_user_model

    from console.core.choices import Role
    from console.core.roles import role_group

    counter = {"n": 0}

    def make(role: str | None = "viewer", username: str | None = None) -> Any:
        counter["n"] += 1
        user = get_user_model().objects.create_user(
            username=username or f"{role or 'norole'}{counter['n']}", password="pw-for-tests-1"
        )
        if role:
            user.groups.add(role_group(Role(role)))
        return user

    return make


@pytest.fixture
def api_as(make_user: Callable[..., Any]) -> Callable[[str | None], APIClient]:
    """An API client authenticated (by token) as a fresh user with the given role;
    ``api_as(None)`` is anonymous."""
    from console.core.services_tokens import api_token_issue

    def client(role: str | None) -> APIClient:
        api = APIClient()
        if role is not None:
            _, token = api_token_issue(actor=None, user=make_user(role))
            api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
        return api

    return client


ROLES = ["anonymous", "viewer", "operator", "admin"]


def role_client(api_as: Callable[[str | None], APIClient], role: str) -> APIClient:
    return api_as(None if role == "anonymous" else role)

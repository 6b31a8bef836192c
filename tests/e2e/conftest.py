"""Browser tests: Playwright driving Debian's Chromium (``/usr/bin/chromium``, headless)
against pytest-django's live server. Without Chromium they skip, except under CI=true where
they fail (``.ci/run`` installs the ``chromium`` package first)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.console.conftest import world  # noqa: F401 - a small two-site system
from tests.orchestrator.conftest import start_worker  # noqa: F401 - a real Celery worker
from tests.support import repo_root, unavailable

CHROMIUM = os.environ.get("PDBRIDGE_CHROMIUM", "/usr/bin/chromium")
SCREENSHOTS = repo_root() / "var" / "screenshots"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the browser tests of a module."""
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("the playwright package is not installed")
    # Playwright's sync API runs an event loop in this thread; the tests' own ORM calls
    # (fixtures, checks) are still plain synchronous code, which Django would refuse while
    # a loop runs. Allowed only while the browser is up.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
            yield browser
            browser.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS

from __future__ import annotations

from typing import Any

import pytest

from console.alerts.services import alert_rules_sync_defaults


@pytest.fixture(autouse=True)
def default_rules(db: Any) -> None:
    """The shipped rules. The migration installs them, but a transactional test elsewhere in
    the run flushes every table (migration data included); installing again is idempotent."""
    alert_rules_sync_defaults()

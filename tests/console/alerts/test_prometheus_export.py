"""deploy/prometheus/alerts.yaml is generated from the shipped rules and kept in sync."""

from __future__ import annotations

import pytest
import yaml
from django.core.management import CommandError, call_command

from console.alerts.defaults import DEFAULT_RULES
from console.alerts.prometheus import EXPORT_PATH, render, rule_expression


def test_the_committed_file_is_in_sync_with_the_defaults():
    assert EXPORT_PATH.read_text() == render(), "run: python manage.py alerts_export"
    call_command("alerts_export", "--check")


def test_every_default_rule_is_exported_with_its_level_and_expression():
    doc = yaml.safe_load(EXPORT_PATH.read_text())
    exported = {r["labels"]["pdbridge_rule"]: r for g in doc["groups"] for r in g["rules"]}
    assert set(exported) == {r["name"] for r in DEFAULT_RULES}
    for rule in DEFAULT_RULES:
        item = exported[rule["name"]]
        assert item["labels"]["severity"] == rule["level"]
        assert item["expr"] == rule_expression(rule)
    assert exported["link-rtt-high"]["expr"] == "avg_over_time(link_rtt_ms[300s]) > 100"
    assert exported["success-rate-low"]["alert"] == "PdbridgeSuccessRateLow"


def test_check_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "alerts.yaml"
    stale.write_text("groups: []\n")
    with pytest.raises(CommandError, match="out of date"):
        call_command("alerts_export", "--check", "--output", str(stale))
    call_command("alerts_export", "--output", str(stale))
    call_command("alerts_export", "--check", "--output", str(stale))

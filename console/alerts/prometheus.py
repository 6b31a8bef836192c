"""The shipped alert rules as Prometheus alerting rules (``deploy/prometheus/alerts.yaml``),
for sites that run Prometheus and Alertmanager next to (or instead of) the console's own
evaluation. Generated, never edited by hand: ``python manage.py alerts_export`` rewrites the
file and ``--check`` fails when it is out of date (a test runs the check). Pure, no Django."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from console.alerts.defaults import DEFAULT_RULES

EXPORT_PATH = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yaml"
HEADER = (
    "# Generated from console/alerts/defaults.py by `python manage.py alerts_export`.\n"
    "# Do not edit: change the defaults and regenerate (a test checks this file is in sync).\n"
)
OPERATORS = {"gt": ">", "lt": "<"}
FUNCTIONS = {
    "avg": "avg_over_time",
    "max": "max_over_time",
    "min": "min_over_time",
    "last": "last_over_time",
}


def _alert_name(name: str) -> str:
    """``link-rtt-high`` -> ``PdbridgeLinkRttHigh`` (Prometheus alert names are CamelCase)."""
    return "Pdbridge" + "".join(part.capitalize() for part in name.split("-"))


def rule_expression(rule: dict[str, Any]) -> str:
    """The PromQL condition of one rule: the window aggregate compared with the threshold."""
    return (
        f"{FUNCTIONS[rule['aggregate']]}({rule['metric']}[{rule['window_s']}s]) "
        f"{OPERATORS[rule['comparison']]} {rule['threshold']:g}"
    )


def prometheus_rules(rules: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The rules document, one group per layer, in the defaults' order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for rule in rules if rules is not None else DEFAULT_RULES:
        groups.setdefault(rule["layer"], []).append(
            {
                "alert": _alert_name(rule["name"]),
                "expr": rule_expression(rule),
                "for": "1m",
                "labels": {
                    "severity": rule["level"],
                    "layer": rule["layer"],
                    "pdbridge_rule": rule["name"],
                },
                "annotations": {"summary": rule["summary"]},
            }
        )
    return {
        "groups": [{"name": f"pdbridge-{layer}", "rules": items} for layer, items in groups.items()]
    }


def render() -> str:
    """The file's full text."""
    return HEADER + yaml.safe_dump(prometheus_rules(), sort_keys=False, width=100)

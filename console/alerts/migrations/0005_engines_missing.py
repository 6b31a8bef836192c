"""The shipped rule ``engines-missing`` (console.alerts.defaults): children an active
deployment needs that its nodes do not report, recorded by the reconcile loop. Added with its
defaults; an existing rule of that name (an operator's) is left alone."""

from typing import Any

from django.db import migrations


def forward(apps: Any, schema_editor: Any) -> None:
    from console.alerts.defaults import DEFAULT_RULES

    rule = next(r for r in DEFAULT_RULES if r["name"] == "engines-missing")
    rules = apps.get_model("alerts", "AlertRule").objects
    rules.get_or_create(name=rule["name"], defaults={k: v for k, v in rule.items() if k != "name"})


def backward(apps: Any, schema_editor: Any) -> None:
    apps.get_model("alerts", "AlertRule").objects.filter(name="engines-missing").delete()


class Migration(migrations.Migration):
    dependencies = [
        ("alerts", "0004_alert_acknowledge"),
    ]

    operations = [
        migrations.RunPython(forward, backward),
    ]

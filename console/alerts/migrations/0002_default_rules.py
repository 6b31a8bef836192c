"""Install the shipped alert rules (console/alerts/defaults.py) once. Rules added to the
defaults later are installed by ``alert_rules_sync_defaults`` (``manage.py alerts_export
--install``); a default an operator deleted stays deleted until then."""

from typing import Any

from django.db import migrations


def install(apps: Any, schema_editor: Any) -> None:
    from console.alerts.defaults import DEFAULT_RULES

    rule_model = apps.get_model("alerts", "AlertRule")
    for rule in DEFAULT_RULES:
        rule_model.objects.get_or_create(name=rule["name"], defaults=rule)


class Migration(migrations.Migration):
    dependencies = [
        ("alerts", "0001_initial"),
    ]

    operations = [
        migrations.RunPython(install, migrations.RunPython.noop),
    ]

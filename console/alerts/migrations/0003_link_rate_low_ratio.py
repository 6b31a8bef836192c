"""``link-rate-low`` compares the measured / provisioned ratio (under 0.5) instead of an
absolute 1,000 Mbit/s, which fired on every link slower than 1 Gbit/s and never on a 100 Gbit/s
link running at a tenth of its rate. A rule an operator tuned (metric or threshold changed) is
left alone."""

from typing import Any

from django.db import migrations

OLD = {"metric": "link_measured_mbit_s", "threshold": 1000.0}
NEW = {
    "metric": "link_measured_ratio",
    "threshold": 0.5,
    "summary": "Measured WAN rate under half the provisioned rate: long prompts may not "
    "ship their KV in time.",
}


def forward(apps: Any, schema_editor: Any) -> None:
    rules = apps.get_model("alerts", "AlertRule").objects
    rules.filter(name="link-rate-low", **OLD).update(**NEW)


def backward(apps: Any, schema_editor: Any) -> None:
    rules = apps.get_model("alerts", "AlertRule").objects
    rules.filter(name="link-rate-low", metric=NEW["metric"], threshold=NEW["threshold"]).update(
        **OLD,
        summary="Measured WAN rate under 1 Gbit/s: long prompts cannot ship their KV in time.",
    )


class Migration(migrations.Migration):
    dependencies = [
        ("alerts", "0002_default_rules"),
    ]

    operations = [
        migrations.RunPython(forward, backward),
    ]

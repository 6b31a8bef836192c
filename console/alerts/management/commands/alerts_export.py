"""``manage.py alerts_export [--check] [--output PATH] [--install]``: write the shipped alert
rules as Prometheus alerting rules; ``--check`` exits 1 when the file differs instead of
writing; ``--install`` also creates the shipped rules missing from the database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from console.alerts.prometheus import EXPORT_PATH, render


class Command(BaseCommand):
    help = "Write deploy/prometheus/alerts.yaml from the shipped alert rules (--check: compare)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--check", action="store_true", help="Fail if the file is stale.")
        parser.add_argument("--output", type=Path, default=EXPORT_PATH)
        parser.add_argument(
            "--install", action="store_true", help="Create shipped rules missing from the database."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["install"]:
            from console.alerts.services import alert_rules_sync_defaults

            created = alert_rules_sync_defaults(actor=None)
            self.stdout.write(f"installed {len(created)} rule(s): {', '.join(created) or '-'}")
        path: Path = options["output"]
        text = render()
        if options["check"]:
            current = path.read_text() if path.exists() else ""
            if current != text:
                raise CommandError(f"{path} is out of date: run `python manage.py alerts_export`.")
            self.stdout.write(f"{path} is up to date.")
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.stdout.write(f"wrote {path}")

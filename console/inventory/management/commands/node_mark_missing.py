"""``pdbridge console node_mark_missing``: escalate nodes whose heartbeats stopped (for cron
or a one-off check; the orchestrator's beat runs the same turn of the liveness loop, which
judges nobody while the console cannot hear heartbeats: console.inventory.liveness)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.utils.dateparse import parse_datetime

from console.inventory.liveness import liveness_check


class Command(BaseCommand):
    help = "Mark nodes degraded / lost from missed heartbeats."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--now", help="Evaluate as of this ISO 8601 time with offset (default: the clock)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        now = None
        if options["now"]:
            now = parse_datetime(options["now"])
            if now is None or now.tzinfo is None:
                self.stderr.write("--now: expected an ISO 8601 datetime with an offset")
                raise SystemExit(2)
        report = liveness_check(now=now)
        if report.blind:
            self.stdout.write(f"console blind, nobody judged: {report.reason}\n")
        changed = report.changed
        self.stdout.write(
            f"degraded: {len(changed['degraded'])} lost: {len(changed['lost'])}"
            + "".join(f"\n{status} {pk}" for status, ids in changed.items() for pk in ids)
        )

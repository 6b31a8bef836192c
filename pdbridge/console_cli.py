"""``pdbridge console ARGS`` = ``manage.py ARGS`` for the installed console."""

from __future__ import annotations

import os


def main(argv: list[str]) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(["pdbridge console", *argv])
    return 0

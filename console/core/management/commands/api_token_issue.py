"""``manage.py api_token_issue USERNAME [--name NAME]``: issue an API token for a user and print
it (the one time it can be read: only its hash is stored). For automation set up from a shell;
operators can also exchange their password at ``POST /api/auth/token/`` or issue one in the
admin. Replaces DRF's ``drf_create_token`` (its tokens were stored in plaintext)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from console.core.services_tokens import api_token_issue


class Command(BaseCommand):
    help = "Issue an API token for USERNAME and print it (shown once; only its hash is stored)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument(
            "--name", default="", help="What the token is for (shown in the admin)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"No user named {options['username']!r}.")
        if not user.is_active:
            raise CommandError(f"User {options['username']!r} is inactive.")
        _, token = api_token_issue(actor=None, user=user, name=options["name"])
        self.stdout.write(token)

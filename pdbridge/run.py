"""``pdbridge run``: the embedded console on one machine.

Migrates the embedded database, loads the shipped fixtures, creates an ``admin`` account the
first time (its password is printed once), collects static files, and serves the console with
gunicorn until Ctrl-C. Later subsystems (worker, agents, gateway) join this command.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path


def _setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()


def _ensure_admin() -> str | None:
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    if user_model.objects.filter(username="admin").exists():
        return None
    password = secrets.token_urlsafe(12)
    user_model.objects.create_superuser("admin", "", password)
    return password


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdbridge run", description=__doc__)
    parser.add_argument("--host", default=os.environ.get("PDBRIDGE_CONSOLE_HOST", "127.0.0.1"))
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("PDBRIDGE_CONSOLE_PORT", "8000"))
    )
    parser.add_argument("--workers", type=int, default=2, help="gunicorn worker processes")
    parser.add_argument(
        "--check", action="store_true", help="prepare everything, print the URL, do not serve"
    )
    args = parser.parse_args(argv)

    _setup_django()
    from django.conf import settings
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)
    call_command("collectstatic", interactive=False, verbosity=0)
    fixtures_dir = Path(settings.BASE_DIR) / "console" / "fixtures"
    for fixture in sorted(fixtures_dir.glob("*.json")) if fixtures_dir.is_dir() else []:
        call_command("loaddata", str(fixture), verbosity=0)
    password = _ensure_admin()

    url = f"http://{args.host}:{args.port}/"
    print(f"pdbridge console: {url}  (API docs: {url}api/docs/)", flush=True)
    if password:
        print(
            f"admin account created: user 'admin', password '{password}' (shown once)", flush=True
        )
    else:
        print("admin account exists (reset: pdbridge console changepassword admin)", flush=True)
    if args.check:
        return 0

    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "console.wsgi:application",
        "--bind",
        f"{args.host}:{args.port}",
        "--workers",
        str(args.workers),
        "--access-logfile",
        "-",
        "--graceful-timeout",
        "10",
    ]
    server = subprocess.Popen(command)  # noqa: S603 - fixed argv, no shell
    try:
        return server.wait()
    except KeyboardInterrupt:
        server.send_signal(signal.SIGTERM)
        return server.wait(timeout=15)

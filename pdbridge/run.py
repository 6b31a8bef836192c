"""``pdbridge run``: the one-command testbed, or the embedded console alone.

By default (``pdbridge.testbed``): two datacenters on this machine with a hybrid model deployed
end to end through the console's deployment workflow. With ``--console-only``: migrates the
embedded database, loads the shipped fixtures, creates an ``admin`` account the first time (its
password is printed once), collects static files, and serves the console with ``pdbridge serve``
(:mod:`pdbridge.console_server`: slow clients hold no thread) until Ctrl-C. ``--check`` prepares the console-only mode and exits.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
from pathlib import Path


def _setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()


def ensure_admin() -> str | None:
    """Create the ``admin`` superuser when missing; returns its new password (else None)."""
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
    parser.add_argument("--workers", type=int, default=2, help="console serving processes")
    parser.add_argument(
        "--check", action="store_true", help="prepare everything, print the URL, do not serve"
    )
    parser.add_argument(
        "--console-only", action="store_true", help="serve the console alone (no testbed)"
    )
    testbed = parser.add_argument_group("testbed (the default mode)")
    testbed.add_argument("--model", choices=["qwen3-next", "smollm2"], default="qwen3-next",
                         help="tiny hybrid reference model, or the real SmolLM2-135M checkpoint")  # fmt: skip
    testbed.add_argument("--engine", choices=["reference", "vllm"], default="reference",
                         help="both sites' engines: pdbridge's reference engine (starts in "
                              "seconds), or real vLLM with pdbridge's KV connector (make "
                              "vllm-env first; serves a tiny Gemma-3)")  # fmt: skip
    testbed.add_argument("--wan-mbit", type=float, default=200.0, help="WAN bandwidth (Mbit/s)")
    testbed.add_argument("--wan-latency-ms", type=float, default=10.0, help="WAN one-way latency")
    testbed.add_argument("--gateway-port", type=int, default=8080, help="0: any free port")
    testbed.add_argument("--netns", action="store_true",
                         help="run the two sites in network namespaces joined by a tbf-shaped "
                              "veth (root, iproute2)")  # fmt: skip
    testbed.add_argument("--remote-sites", type=int, default=1, metavar="N",
                         help="remote prefill sites (1-3: remote, remote-b, remote-c), each "
                              "with its own agent, prefill pool and shaped WAN path")  # fmt: skip
    testbed.add_argument("--var-dir", default=os.environ.get("PDBRIDGE_TESTBED_DIR", "var/testbed"))
    testbed.add_argument("--deploy-timeout", type=float, default=900.0, help="seconds")
    testbed.add_argument(
        "--deploy-retries",
        type=int,
        default=2,
        help="retries of a failed step, each after a doubling pause (2 s, 4 s, ... up to 15 s)",
    )
    testbed.add_argument("--ready-file", default="", help="write the endpoints as JSON when up")
    testbed.add_argument(
        "--exit-after", type=float, default=0.0, help="stop after N s up (0: never)"
    )
    args = parser.parse_args(argv)
    if not args.wan_mbit > 0:
        parser.error(f"--wan-mbit: must be positive, got {args.wan_mbit}")
    if args.wan_latency_ms < 0:
        parser.error(f"--wan-latency-ms: must be 0 or more, got {args.wan_latency_ms}")
    if args.netns and (args.console_only or args.check):
        parser.error("--netns: runs the testbed's sites; not with --console-only or --check")
    if not 1 <= args.remote_sites <= 3:
        parser.error(f"--remote-sites: 1 to 3 remote prefill sites, got {args.remote_sites}")
    if args.remote_sites != 1 and (args.console_only or args.check):
        parser.error("--remote-sites: the testbed's sites; not with --console-only or --check")
    if args.engine != "reference" and (args.console_only or args.check):
        parser.error("--engine: the testbed's engines; not with --console-only or --check")
    if args.engine == "vllm" and args.model != "qwen3-next":
        parser.error(
            "--model: the reference engine's models; --engine vllm serves its own tiny Gemma-3"
        )
    if not (args.console_only or args.check):
        from pdbridge import testbed as testbed_main

        if args.port == 8000 and "PDBRIDGE_CONSOLE_PORT" not in os.environ:
            args.port = 8443  # the testbed's console speaks TLS (agents require it)
        return testbed_main.main(args)

    _setup_django()
    from django.conf import settings
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)
    call_command("collectstatic", interactive=False, verbosity=0)
    fixtures_dir = Path(settings.BASE_DIR) / "console" / "fixtures"
    for fixture in sorted(fixtures_dir.glob("*.json")) if fixtures_dir.is_dir() else []:
        call_command("loaddata", str(fixture), verbosity=0)
    password = ensure_admin()

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

    from pdbridge.console_server import ServerConfig, command

    served = ServerConfig(bind=[f"{args.host}:{args.port}"], workers=args.workers, access_log=True)
    server = subprocess.Popen(command(served))  # noqa: S603 - fixed argv, no shell
    try:
        return server.wait()
    except KeyboardInterrupt:
        server.send_signal(signal.SIGTERM)
        return server.wait(timeout=15)

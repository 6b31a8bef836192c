"""Console benchmark: what a config poll and a heartbeat cost, side by side in one process.
``make bench-console`` (``python -m bench.console``).

Runs against a throw-away embedded database (SQLite in a temporary directory, migrated and
filled through the services) with Django's in-process test client, so it measures the
console's own work (auth, permission, queries, rendering), not a network:

* full config read (200, body rendered from the snapshot) with a user token;
* the same poll with ``If-None-Match`` = current version (304) with a user token and with a
  node token — what every gateway and agent does every few seconds;
* one heartbeat (validation, row lock, update) with a node token.

Writes ``var/bench/console.json`` and prints a summary. CPU timing on a shared machine is
noisy: read the ratios and the order of magnitude.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import write_json

OUTPUT = Path("var/bench/console.json")


def _setup(var_dir: str, database_url: str | None) -> Callable[[], None]:
    """Configure Django on a fresh database; returns the clean-up to call at the end. With
    ``database_url`` (Postgres) a throw-away ``test_<name>`` database is created there."""
    os.environ["PDBRIDGE_ENV"] = "test"
    os.environ["PDBRIDGE_VAR_DIR"] = var_dir
    os.environ["DATABASE_URL"] = database_url or f"sqlite:///{var_dir}/bench.sqlite3"
    os.environ["DJANGO_SETTINGS_MODULE"] = "console.settings"
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    if database_url is None:
        call_command("migrate", interactive=False, verbosity=0)
        return lambda: None
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True)
    return lambda: connection.creation.destroy_test_db(old_name, verbosity=0)


def _world() -> dict[str, Any]:
    """Two sites, a model, a deployment with a decode and a prefill pool of 8 nodes each."""
    from django.contrib.auth import get_user_model

    from console.catalog.services import model_create
    from console.core.choices import Role
    from console.core.roles import role_group
    from console.core.services_tokens import api_token_issue
    from console.deployments.services import deployment_create, pool_create
    from console.inventory.services import link_create, node_create, node_token_issue, site_create

    local = site_create(actor=None, name="local", role="decode")
    remote = site_create(actor=None, name="remote", role="prefill")
    link_create(actor=None, from_site=remote, to_site=local, provisioned_mbit_s=100_000)
    nodes = {
        site.name: [
            node_create(
                actor=None,
                site=site,
                hostname=f"{site.name}-{i}",
                agent_address=f"10.0.{n}.{i + 1}:7070",
            )
            for i in range(8)
        ]
        for n, site in enumerate((local, remote))
    }
    arch = {"layers": [{"kind": "full", "count": 4, "kv_heads": 2, "head_dim": 64}]}
    model = model_create(
        actor=None, name="bench", architecture=arch, parameter_count=1, weights_sha256="a" * 64
    )
    deployment = deployment_create(actor=None, name="bench", model=model)
    pool_create(actor=None, deployment=deployment, role="decode", site=local, nodes=nodes["local"])
    pool_create(
        actor=None, deployment=deployment, role="prefill", site=remote, nodes=nodes["remote"]
    )
    deployment.refresh_from_db()
    user = get_user_model().objects.create_user("bench")  # token auth only: no password
    user.groups.add(role_group(Role.VIEWER))
    return {
        "deployment": deployment,
        "user_token": api_token_issue(actor=None, user=user)[1],
        "node_token": node_token_issue(actor=None, node=nodes["remote"][0]),
    }


def timed(cases: dict[str, Callable[[], Any]], count: int) -> dict[str, dict[str, float]]:
    """Per-request median of each case over ``count`` rounds, the cases interleaved round by
    round so that drift in machine load hits them alike (after a warm-up of 20 rounds)."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(count + 20):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            if round_ >= 20:
                samples[name].append(time.perf_counter() - start)
    results = {}
    for name, values in samples.items():
        median = statistics.median(values)
        results[name] = {
            "median_ms": round(median * 1000, 3),
            "per_s": round(1 / median, 1),
            "requests": count,
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console", description=__doc__)
    parser.add_argument("--requests", type=int, default=300, help="requests per case")
    parser.add_argument(
        "--database-url",
        help="a Postgres server to create a throw-away test database on "
        "(default: embedded SQLite in a temporary directory)",
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="pdbridge-bench-") as var_dir:
        cleanup = _setup(var_dir, args.database_url)
        from django.test import Client

        world = _world()
        client = Client()
        url = f"/api/deployments/{world['deployment'].pk}/config/"
        user = {"HTTP_AUTHORIZATION": f"Token {world['user_token']}"}
        node = {"HTTP_AUTHORIZATION": f"Bearer {world['node_token']}"}
        tag = f'"{world["deployment"].version}"'
        beat = json.dumps(
            {"agent_version": "bench", "clock": "2026-11-29T17:40:00Z", "config_versions": {"1": 3}}
        )

        def check(status: int, response: Any) -> Any:
            if response.status_code != status:
                raise SystemExit(f"unexpected {response.status_code}: {response.content[:200]!r}")
            return response

        cases = {
            "config_full_200_user": lambda: check(200, client.get(url, **user)),
            "config_poll_304_user": lambda: check(
                304, client.get(url, HTTP_IF_NONE_MATCH=tag, **user)
            ),
            "config_poll_304_node": lambda: check(
                304, client.get(url, HTTP_IF_NONE_MATCH=tag, **node)
            ),
            "heartbeat_node": lambda: check(
                200, client.post("/api/heartbeats/", beat, content_type="application/json", **node)
            ),
        }
        results = timed(cases, args.requests)
        body_bytes = len(client.get(url, **user).content)
        from django.db import connection

        database = connection.vendor
        cleanup()

    full = results["config_full_200_user"]["median_ms"]
    report = {
        "benchmark": "console",
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "database": database,
        "config_body_bytes": body_bytes,
        "results": results,
        "ratios": {
            "full_over_poll_user": round(full / results["config_poll_304_user"]["median_ms"], 2),
            "full_over_poll_node": round(full / results["config_poll_304_node"]["median_ms"], 2),
        },
    }
    write_json(OUTPUT, report)
    for name, row in results.items():
        print(f"{name:24s} {row['median_ms']:8.3f} ms  {row['per_s']:8.1f}/s")
    print(f"database {database}; config body {body_bytes} bytes; full / 304: {report['ratios']}")
    print(f"written to {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

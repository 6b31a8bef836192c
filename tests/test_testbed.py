"""``pdbridge run`` smoke test on real processes: the testbed comes up, the deploy run's eight
steps succeed with the canary at 100 %, a request through the gateway is served on the remote
path with tokens, the printed ``curl`` line works, and SIGTERM leaves no process behind and
frees the ports. Drills run through the console's REST API with the defaults an operator gets:
a remote restart passes (0 failed requests, remote and fallback samples verified), a drill
whose only verification sample is below the threshold fails ``require_verification``. The
same with ``--netns`` (root): the sites run in two namespaces, the WAN probe sees the
tbf-shaped veth, a link-cut drill passes, and shutdown removes the namespaces too. With
``--remote-sites 2``: both prefill sites deployed, each with its own WAN path, and a link-cut
drill of one site started through the testbed's API fails its traffic over to the other site
(0 failed requests, no full timeout waited, at most a handful of fallbacks) and traffic returns
to it once restored."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from pdbridge.procgroup import port_is_free, terminate_session
from tests.netns import require_netns
from tests.support import deadline_in, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = [
    "capacity_baseline", "wan_baseline", "remote_prefill", "local_decode",
    "kv_link", "gateway", "verification", "canary",
]  # fmt: skip
# The test process's own settings must not leak into the testbed (it has its own database).
FOREIGN = (
    "DJANGO_SETTINGS_MODULE",
    "DATABASE_URL",
    "CELERY_BROKER_URL",
    "REDIS_URL",
    "PDBRIDGE_ENV",
)


def marked_processes(mark: str) -> list[int]:
    """Live processes whose environment carries ``mark`` (the testbed and everything under it)."""
    found = []
    needle = f"PDBRIDGE_SMOKE_MARK={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def probe_evidence(ready: dict, db: sqlite3.Connection) -> dict:
    """Step 2's first probe, as recorded in the run's evidence."""
    return json.loads(
        db.execute(
            "SELECT evidence FROM runs_steprun WHERE run_id = ? AND name = 'wan_baseline'",
            (ready["deploy_run"],),
        ).fetchone()[0]
    )["probes"][0]


def traced_request(ready: dict, api: ConsoleApi) -> dict:
    """One request with the client's own ``X-Request-Id`` through the testbed's gateway, as a
    user would follow it (docs/runbook.md, "Reading a trace"): its id in the gateway's, both
    engines' and the KV link's log lines on each site, and its trace on the console with every
    leg, found by that id."""
    rid = f"smoke-{uuid.uuid4().hex[:12]}"
    context = ssl.create_default_context(cafile=ready["ca"])
    body = {"model": ready["served_model"], "max_tokens": 4,
            "prompt": "Follow this one request across both sites, please. " * 8}  # fmt: skip
    request = urllib.request.Request(  # noqa: S310 - the testbed's gateway
        f"{ready['gateway_url']}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": rid},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=60, context=context) as response:  # noqa: S310
        assert response.headers["x-request-id"] == rid
        assert response.headers["x-pdbridge-path"] == "remote"
    logs = Path(ready["var_dir"]) / "sites"
    expected = {
        "local/state/logs": ["gateway.remote_served", "transfer_begun", "transfer_finished",
                             "kv_imported", "path=remote"],
        "remote/state/logs": ["transfer_sent", "kv_sent", "path=prefill"],
    }  # fmt: skip
    deadline = deadline_in(60)
    while True:
        lines = {
            where: [
                line
                for log in (logs / where).glob("*.log")
                for line in log.read_text(errors="replace").splitlines()
                if rid in line
            ]
            for where in expected
        }
        missing = [
            (where, word)
            for where, words in expected.items()
            for word in words
            if not any(word in line for line in lines[where])
        ]
        found = api.call("GET", f"/api/telemetry/traces/?request_id={rid}")[1].get("results")
        if not missing and found:
            break
        assert time.monotonic() < deadline, (missing, lines, found)
        time.sleep(1)
    status, trace = api.call("GET", f"/api/telemetry/traces/{found[0]['id']}/")
    assert status == 200, trace
    return trace


def leg_log_lines(api: ConsoleApi, trace: dict) -> dict[str, list[str]]:
    """Each leg's lines of the request, read as an operator follows the trace's log links:
    through the console, which reads them through each node's agent (``log_pages`` are the
    pages; the API serves the same read under /api)."""
    lines: dict[str, list[str]] = {}
    for leg in trace["timeline"]:
        for page in (leg.get("logs") or {}).get("log_pages", {}).values():
            status, body = api.call("GET", "/api" + page)
            assert status == 200, (page, body)
            lines.setdefault(leg["leg"], []).extend(body["lines"])
    return lines


@pytest.fixture(scope="module")
def testbed_var(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``--var-dir`` for the plain and the ``--netns`` testbed: the second is a restart of
    the first (a fresh database whose run ids begin again at 1, the PKI and the drills'
    directories kept), as an operator restarts ``make run``."""
    return tmp_path_factory.mktemp("testbed-var")


def test_make_run_reaches_full_share_serves_remote_and_shuts_down_clean(tmp_path, testbed_var):
    seen: dict[str, dict] = {}

    def while_up(ready: dict, db: sqlite3.Connection) -> None:
        seen["probe"] = probe_evidence(ready, db)
        api = ConsoleApi(ready, (tmp_path / "run.out").read_text())
        seen["trace"] = traced_request(ready, api)
        seen["leg_logs"] = leg_log_lines(api, seen["trace"])
        # The drills an operator runs from the console, with the testbed's defaults.
        # With every default (the verification sample sized from the threshold the gateway
        # applies then), twice in a row.
        seen["restart"] = api.drill(ready, "remote_restart")
        # A cut well above the KV link's unreachable_ms (3 s), as docs/runbook.md asks.
        seen["cut"] = api.drill(ready, "link_cut", fault_s=10)
        seen["agent_kill"] = agent_killed_under_load(ready, api, tmp_path)
        # A sample below the threshold can only go local: the remote path was not verified.
        seen["local_only"] = api.drill(ready, "link_cut", baseline_s=2, fault_s=3, after_s=1,
                                       targets={"verify_prompts": [16]})  # fmt: skip

    ready, _ = smoke(tmp_path, [], while_up, testbed_var)

    assert ready["namespaces"] == []
    assert ready["gateway_url"].startswith("https://localhost:")
    # The WAN probe crossed the shaping proxy (200 Mbit/s by default), as the KV does: on
    # loopback alone it would measure hundreds of Mbit/s more than the link has.
    assert 0 < seen["probe"]["mbit_s"] <= 220, seen["probe"]
    trace = seen["trace"]
    assert (trace["path"], trace["document"]["site"]) == ("remote", "remote")
    legs = {leg["leg"]: leg for leg in trace["timeline"]}
    assert list(legs) == ["queue", "prefill", "transfer", "decode", "first_token"]
    # Each leg names the node whose log holds it and the command that reads it there.
    assert "dep" in legs["prefill"]["logs"]["command"]
    assert trace["request_id"] in legs["prefill"]["logs"]["command"]
    assert legs["decode"]["logs"]["hostname"]
    # The log links of the trace open each site's lines of this request, read through its agent.
    leg_logs = seen["leg_logs"]
    assert any("kv_sent" in line for line in leg_logs["prefill"]), leg_logs
    assert any("kv_imported" in line for line in leg_logs["decode"]), leg_logs
    assert all(trace["request_id"] in line for leg in leg_logs.values() for line in leg)
    check_drill_passed(seen["restart"])
    check_drill_passed(seen["cut"])
    kill = seen["agent_kill"]
    print(f"\nagent kill -9 under load: {kill}")
    assert kill["load"]["failed"] == 0, kill
    # During the gap the API named the missing engine (the node lost, or back without it).
    assert kill["gap_seen"]["state"] in {"node lost", "node degraded", "absent"}, kill
    assert kill["back_s"] <= 30, kill
    assert kill["alert"] == "engines-missing", kill
    local_only = seen["local_only"]
    assert local_only["state"] == "failed"
    # Why, in one line (the report page shows it at the top).
    assert (
        "verification: no verification sample went remote (16 chars local; the gateway's "
        "threshold then: "
    ) in local_only["reason"], local_only["reason"]
    rows = {r["criterion"]: r["passed"] for r in local_only["criteria_results"]}
    assert rows["require_verification"] is False
    assert local_only["verification"]["remote_compared"] == 0
    assert {p["path"] for p in local_only["verification"]["prompts"]} == {"local"}
    assert local_only["failed_requests"] == 0  # the drill itself cost no client request


def agent_killed_under_load(ready: dict, api: ConsoleApi, tmp_path: Path) -> dict:
    """kill -9 of the remote site's agent under load, as an operator would meet it: the
    testbed starts it again after 3 s (as its systemd unit would), the console's reconcile
    loop relaunches its prefill engine. Returns what the console API showed during the gap,
    how long after the agent's return the engine served again, and the load's summary."""
    state = Path(ready["var_dir"]) / "sites" / "remote" / "state" / "agent.json"
    deployment = ready["deployment_id"]
    child = f"dep{deployment}-prefill"
    summary = tmp_path / "kill-load.json"
    load = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "loadgen", "--url", ready["gateway_url"],
         "--model", ready["served_model"], "--duration-s", "40", "--concurrency", "2",
         "--mix", "1:200:0.3", "--min-prompt-tokens", "100", "--max-prompt-tokens", "300",
         "--max-tokens", "4", "--timeout-s", "120", "--ca", ready["ca"],
         "--output", str(tmp_path / "kill-load.jsonl"), "--summary", str(summary)],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "kill-load.log").open("wb"),
        env=subprocess_env(),
    )  # fmt: skip

    def missing() -> dict | None:
        status, rows = api.call("GET", f"/api/deployments/{deployment}/engines/")
        assert status == 200, rows
        return next((r for r in rows if r["child"] == child), None)

    time.sleep(5)  # the load runs remote first
    old = json.loads(state.read_text())
    os.kill(old["pid"], signal.SIGKILL)
    deadline = deadline_in(120)
    gap_seen = None
    while (info := json.loads(state.read_text()))["pid"] == old["pid"]:
        gap_seen = gap_seen or missing()
        assert time.monotonic() < deadline, "the testbed did not start the agent again"
        time.sleep(0.5)
    returned = time.monotonic()
    while (row := missing()) is not None:
        gap_seen = gap_seen or row
        assert time.monotonic() < deadline, row
        time.sleep(0.5)
    back_s = time.monotonic() - returned
    alert = None
    while alert is None:
        _, page = api.call(
            "GET", f"/api/alerts/?subject_type=deployments.deployment&subject_id={deployment}"
        )
        alert = next(
            (a["rule_name"] for a in page["results"] if a["rule_name"] == "engines-missing"), None
        )
        assert time.monotonic() < deadline + 120, page
        time.sleep(2)
    load.wait(180)
    return {
        "gap_seen": gap_seen,
        "back_s": round(back_s, 1),
        "new_port": info["port"],
        "alert": alert,
        "load": json.loads(summary.read_text()),
    }


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def net_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


@pytest.mark.netns
def test_make_run_netns_runs_the_sites_in_namespaces_and_removes_them(tmp_path, testbed_var):
    require_netns()
    seen: dict[str, object] = {}

    def while_up(ready: dict, db: sqlite3.Connection) -> None:
        seen["namespaces_while_up"] = set(ready["namespaces"]) <= namespaces()
        # Each agent runs inside its site's namespace, not in ours.
        pids = {
            site: subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                 check=True).stdout.split()
            for site, ns in zip(("local", "remote"), ready["namespaces"], strict=True)
        }  # fmt: skip
        seen["pids"] = pids
        seen["own_ns"] = {net_namespace(int(p)) for ps in pids.values() for p in ps} & {
            net_namespace(os.getpid())
        }
        seen["probe"] = probe_evidence(ready, db)
        # A link cut through the API, cut where the testbed's WAN path is (the remote agent's
        # fault proxy, in its namespace). The prefill engines' KV senders give an unreachable
        # receiver up after the link's unreachable_ms (3 s, not the 15 s KV deadline): the
        # requests sent at the cut fall back then and the breaker opens, well inside 10 s.
        api = ConsoleApi(ready, (tmp_path / "run.out").read_text())
        seen["cut"] = api.drill(ready, "link_cut", fault_s=10)

    # A restart on the first testbed's var dir: its drill's run id is one the first testbed's
    # drills had too (it once met their files and stopped after 6 s, "fault ... active").
    ready, output = smoke(tmp_path, ["--netns", "--wan-mbit", "100"], while_up, testbed_var)

    local_ns, remote_ns = ready["namespaces"]
    assert local_ns.endswith(remote_ns.rsplit("-", 1)[1])  # one random suffix per run
    assert seen["namespaces_while_up"] is True
    assert all(seen["pids"].values()), seen["pids"]  # agents, engines, gateway... inside
    assert seen["own_ns"] == set()
    local_ip = ready["agents"]["local"].rsplit(":", 1)[0]
    remote_ip = ready["agents"]["remote"].rsplit(":", 1)[0]
    assert ready["gateway_url"].startswith(f"https://{local_ip}:")
    assert not local_ip.startswith("127.")
    assert not remote_ip.startswith("127.")
    # The WAN probe (remote agent -> the shaper in its own site -> the local kv-link) crossed
    # the tbf-shaped veth.
    probe = seen["probe"]
    assert probe["from"] == remote_ip
    assert probe["to"].startswith(f"{remote_ip}:")
    assert 0 < probe["mbit_s"] <= 110
    check_drill_passed(seen["cut"])
    # Detected by the senders' unreachable bound (3 s) plus a local prefill, not the deadline.
    assert seen["cut"]["time_to_detect_s"] < 10, seen["cut"]
    assert f"removed namespaces {local_ns}, {remote_ns}" in output
    assert not {local_ns, remote_ns} & namespaces()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    suffix = local_ns.rsplit("-", 1)[1]
    assert suffix not in links.stdout


class ConsoleApi:
    """The testbed console's REST API as an operator uses it: a token for ``admin`` (the
    password the testbed printed), JSON in and out."""

    def __init__(self, ready: dict, output: str) -> None:
        self.url = ready["console_url"]
        self.context = ssl.create_default_context(cafile=ready["ca"])
        password = re.search(r"login:\s+admin / (\S+)", output)
        assert password, output[-3000:]
        _, body = self.call("POST", "/api/auth/token/", {"username": "admin",
                                                          "password": password[1]})  # fmt: skip
        self.token = body["token"]

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if getattr(self, "token", None):
            headers["Authorization"] = f"Token {self.token}"
        request = urllib.request.Request(  # noqa: S310 - the testbed's console
            self.url + path, method=method, headers=headers,
            data=None if body is None else json.dumps(body).encode(),
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.context) as r:  # noqa: S310
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def wait_for_report(self, drill: dict) -> dict:
        """The report of a drill started by ``POST /api/drills/``, once it is no longer
        running (as the console's report page polls it)."""
        report_id = drill["last_report"]["id"]
        deadline = deadline_in(300)
        while (report := self.call("GET", f"/api/drill-reports/{report_id}/")[1])["state"] == (
            "running"
        ):
            assert time.monotonic() < deadline, report
            time.sleep(1)
        return report

    def drill(self, ready: dict, kind: str, **fields) -> dict:
        """Create and run a drill of every prefill site with the defaults an operator gets
        (gateway, decode engine and faults derived from the deployment), short windows and
        load over the remote threshold; returns its finished report."""
        status, drill = self.call("POST", "/api/drills/", {
            "name": f"{kind.replace('_', '-')}-{uuid.uuid4().hex[:6]}",
            "deployment": ready["deployment_id"], "kind": kind,
            "baseline_s": 3, "fault_s": 5, "after_s": 2, "recover_timeout_s": 90,
            "load_profile": DRILL_LOAD, "criteria": {"max_time_to_recover_s": 90}, **fields,
        })  # fmt: skip
        assert status == 201, drill
        return self.wait_for_report(drill)


#: A drill's load on the testbed: every prompt over the 64-token remote threshold.
DRILL_LOAD = {"concurrency": 3, "mix": "1:200:0.3", "min_prompt_tokens": 100,
              "max_prompt_tokens": 300, "max_tokens": 4}  # fmt: skip


def check_drill_passed(report: dict) -> None:
    """A drill of every prefill site, as its report on the console shows it: passed, no
    client request failed, requests listed by window and path (remote before and after,
    fallback during), and verified on both paths: a sample served remote after the fault and
    one served by the fallback during it, each matching the decode engine alone."""
    print(f"\n{report['kind']} drill: {report['requests']}, "
          f"detect {report['time_to_detect_s']} s, recover {report['time_to_recover_s']} s")  # fmt: skip
    assert report["state"] == "passed", (report["reason"], report["verification"])
    assert report["failed_requests"] == 0
    requests = report["requests"]
    assert requests["before"].get("remote/ok", 0) > 0
    assert requests["during"].get("fallback/ok", 0) > 0
    assert requests["after"].get("remote/ok", 0) > 0
    verification = report["verification"]
    assert [(p["path"], p["match"]) for p in verification["prompts"]] == [("remote", True)]
    assert (verification["during"]["path"], verification["during"]["match"]) == ("fallback", True)
    assert all(r["passed"] for r in report["criteria_results"])


def test_make_run_two_remote_sites_a_one_site_link_cut_fails_over_to_the_other(tmp_path):
    seen: dict[str, object] = {}

    def while_up(ready: dict, db: sqlite3.Connection) -> None:
        pools = db.execute(
            "SELECT s.name, p.role FROM deployments_pool p JOIN inventory_site s "
            "ON s.id = p.site_id WHERE p.deployment_id = ? ORDER BY s.name",
            (ready["deployment_id"],),
        ).fetchall()
        seen["pools"] = pools
        seen["links"] = db.execute(
            "SELECT f.name, t.name FROM inventory_link l JOIN inventory_site f "
            "ON f.id = l.from_site_id JOIN inventory_site t ON t.id = l.to_site_id ORDER BY f.name"
        ).fetchall()
        seen["probes"] = sorted(
            p["from_site"]
            for p in json.loads(db.execute(
                "SELECT evidence FROM runs_steprun WHERE run_id = ? AND name = 'wan_baseline'",
                (ready["deploy_run"],),
            ).fetchone()[0])["probes"]
        )  # fmt: skip
        api = ConsoleApi(ready, (tmp_path / "run.out").read_text())
        # The user's way: a link-cut drill of site "remote" through the API, under load (every
        # prompt over the 64-token remote threshold), site "remote-b" kept.
        status, drill = api.call("POST", "/api/drills/", {
            "name": "cut-remote", "deployment": ready["deployment_id"], "kind": "link_cut",
            "site": "remote", "baseline_s": 4, "fault_s": 8, "after_s": 3,
            "recover_timeout_s": 90,
            "load_profile": {"concurrency": 3, "mix": "1:200:0.3", "min_prompt_tokens": 100,
                             "max_prompt_tokens": 300, "max_tokens": 4},
            # Failed over within the senders' unreachable_ms (3 s), the cut site's measured
            # prefill latency steers traffic to remote-b after a request or two: its breaker
            # need never trip, so it is not asked for here.
            "criteria": {"max_fallback_requests": 5, "max_time_to_recover_s": 90,
                         "require_breaker_open": False},
            "targets": {"verify_prompts": [200]},
        })  # fmt: skip
        assert status == 201, drill
        seen["report"] = api.wait_for_report(drill)
        bad = api.call("POST", "/api/drills/", {"name": "cut-west", "kind": "link_cut",
                                                "deployment": ready["deployment_id"],
                                                "site": "west", "run_now": False})  # fmt: skip
        seen["bad_site"] = bad

    ready, _ = smoke(tmp_path, ["--remote-sites", "2"], while_up)

    assert sorted(ready["agents"]) == ["local", "remote", "remote-b"]
    assert seen["pools"] == [("local", "decode"), ("remote", "prefill"), ("remote-b", "prefill")]
    assert seen["links"] == [("remote", "local"), ("remote-b", "local")]
    assert seen["probes"] == ["remote", "remote-b"]  # each site's own WAN path probed
    report = seen["report"]
    print(f"\none-site link cut: {report['requests']}, sites {report['sites']}, "
          f"detect {report['time_to_detect_s']} s, recover {report['time_to_recover_s']} s")  # fmt: skip
    assert report["state"] == "passed", report["criteria_results"]
    assert (report["site"], report["sites"]["faulted"]) == ("remote", "remote")
    assert report["failed_requests"] == 0
    served = report["sites"]["served"]
    assert served["before"].get("remote", 0) > 0
    assert served["before"].get("remote-b", 0) > 0
    # While remote was cut, remote-b served (a request that started as the cut was being
    # injected may still have got its KV through remote).
    assert served["during"].get("remote-b", 0) >= 10
    assert served["during"].get("remote", 0) <= 2
    during = report["requests"]["during"]
    assert sum(n for k, n in during.items() if k.startswith("fallback/")) <= 5
    # No request waited the full TTFT budget (the deployment's 15 s KV timeout, after which
    # it would have fallen back): the few that were on remote when it was cut were failed
    # over at the site timeout (half of it), the rest went to remote-b at once.
    failover = report["sites"]["failover_ttft"]
    assert failover["n"] >= 1
    assert failover["max"] < 15
    assert report["ttft"]["during"]["all"]["p50"] < 2
    # Restored: traffic returns to remote.
    assert served["after"].get("remote", 0) >= 1
    assert report["time_to_recover_s"] is not None
    rows = {r["criterion"]: r["passed"] for r in report["criteria_results"]}
    assert rows["require_failover"] is True
    assert rows["max_fallback_requests"] is True
    assert "require_fallback" not in rows
    status, body = seen["bad_site"]
    assert status == 400
    assert body["site"] == [
        "site: 'west' is not a prefill site of deployment demo (one of: remote, remote-b; "
        "empty: every prefill site)"
    ]


def smoke(
    tmp_path: Path, args: list[str], while_up=None, var_dir: Path | None = None
) -> tuple[dict, str]:
    """Run the testbed with ``args`` (on ``var_dir``, else a new one) through the whole smoke
    check; ``while_up(ready, db)`` looks at it while it is up. Returns the ready file and the
    output."""
    mark = uuid.uuid4().hex
    env = {k: v for k, v in subprocess_env(PDBRIDGE_SMOKE_MARK=mark).items() if k not in FOREIGN}
    ready_file = tmp_path / "ready.json"
    out = (tmp_path / "run.out").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "run", "--port", "0", "--gateway-port", "0",
         "--var-dir", str(var_dir or tmp_path / "var"), "--ready-file", str(ready_file), *args],
        env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = deadline_in(900)
        while not ready_file.exists():
            assert proc.poll() is None, (tmp_path / "run.out").read_text()[-5000:]
            assert time.monotonic() < deadline, (tmp_path / "run.out").read_text()[-5000:]
            time.sleep(1)
        ready = json.loads(ready_file.read_text())
        output = (tmp_path / "run.out").read_text()

        for index, name in enumerate(STEPS, start=1):
            assert f"step {index}/8 {name}: succeeded" in output
        db = sqlite3.connect(Path(ready["var_dir"]) / "pdbridge.sqlite3")
        steps = db.execute(
            'SELECT name, state FROM runs_steprun WHERE run_id = ? ORDER BY "index"',
            (ready["deploy_run"],),
        ).fetchall()
        assert steps == [(name, "succeeded") for name in STEPS]
        state, share = db.execute(
            "SELECT state, remote_share_percent FROM deployments_deployment WHERE id = ?",
            (ready["deployment_id"],),
        ).fetchone()
        if while_up is not None:
            while_up(ready, db)
        assert (state, share) == ("active", 100)

        # Both agents report mTLS and the hash of the weights their engine serves, equal to
        # the catalog's: the readiness checklist's weights and certificates items have data.
        def reports() -> list[tuple[str, dict, list]]:
            rows = db.execute(
                "SELECT hostname, reported_tls, reported_weights FROM inventory_node"
            ).fetchall()
            return [(h, json.loads(t or "null"), json.loads(w or "null")) for h, t, w in rows]

        (catalog_sha,) = db.execute(
            "SELECT m.weights_sha256 FROM catalog_modelspec m JOIN deployments_deployment d "
            "ON d.model_id = m.id WHERE d.id = ?",
            (ready["deployment_id"],),
        ).fetchone()
        deadline = deadline_in(60)
        while not all(w and {e["state"] for e in w} == {"ok"} for _, _, w in reports()):
            assert time.monotonic() < deadline, reports()
            time.sleep(1)
        final = reports()
        db.close()
        assert len(catalog_sha) == 64
        assert len(final) == len(ready["agents"])  # a node per site
        for _, tls, weights in final:
            assert tls["mtls"] is True
            assert tls["not_after"] > time.strftime("%Y-%m-%d")
            assert [e["sha256"] for e in weights if e["child"]] == [catalog_sha]

        # A fresh prompt over the threshold goes the remote way and returns tokens.
        context = ssl.create_default_context(cafile=ready["ca"])
        prompt = "A fresh prompt for the smoke test, long enough to be prefilled remotely. " * 6
        # Token ids: vLLM returns them only when asked (the reference engine always does).
        body = {"model": ready["served_model"], "prompt": prompt, "max_tokens": 8,
                "return_token_ids": True}  # fmt: skip
        request = urllib.request.Request(  # noqa: S310 - the testbed's gateway
            f"{ready['gateway_url']}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60, context=context) as response:  # noqa: S310
            answer = json.loads(response.read())
            assert response.headers["x-pdbridge-path"] == "remote"
        # Random weights may sample the end-of-text token early: at least one token, counted.
        assert 1 <= answer["usage"]["completion_tokens"] <= 8
        assert len(answer["choices"][0]["token_ids"]) == answer["usage"]["completion_tokens"]

        # The printed curl line works as printed (first use of its prompt: remote).
        [line] = [x for x in output.splitlines() if x.strip().startswith("try:")]
        if shutil.which("curl"):
            argv = shlex.split(line.split("try:", 1)[1])
            curl = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            assert curl.returncode == 0, curl.stderr
            assert "200 OK" in curl.stdout.splitlines()[0]
            assert "x-pdbridge-path: remote" in curl.stdout
            printed = json.loads(curl.stdout.replace("\r\n", "\n").split("\n\n", 1)[1])
            assert 1 <= printed["usage"]["completion_tokens"] <= 16
        assert marked_processes(mark), "the testbed's processes carry the mark"
    finally:
        stopped_in_time = terminate_session(proc)
        out.close()

    output = (tmp_path / "run.out").read_text()
    assert stopped_in_time
    assert proc.returncode == 0, output[-3000:]
    assert "stopped" in output
    assert "killed leftover process" not in output
    assert marked_processes(mark) == []
    console_port = int(ready["console_url"].rsplit(":", 1)[1])
    gateway_port = int(ready["gateway_url"].rsplit(":", 1)[1])
    assert port_is_free(console_port)
    if not ready["namespaces"]:  # with --netns the gateway's port was in a namespace
        assert port_is_free(gateway_port)
    return ready, output

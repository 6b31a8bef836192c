"""``pdbridge soak`` (``make soak``): the testbed under mixed load for a while, with a remote
engine restart and a WAN link cut on the way; fails on resource growth or any failed request.

Starts ``pdbridge run`` (its own process group), waits until it is up, runs ``pdbridge loadgen``
against its gateway (log-normal prompt mix: both remote and local paths) for ``--duration-s``,
and through the remote agent (mTLS, the controller certificate) restarts the prefill engine at
``--restart-at`` and cuts the WAN for ``--cut-s`` at ``--cut-at`` (fractions of the duration).
RSS and open file descriptors of every testbed process are sampled after ``--warmup-s`` and at
the end (a few readings each: the fewest fds, the median RSS), summed per role (console, worker, agent-remote, engine-prefill, ...).
RSS per role is also sampled every ``--sample-every-s`` (the report's ``rss_series``; printed for
a role that grew), so a climb can be told from a step at a fault.

Fails (exit 1) when a role's RSS or fds grew by more than ``--max-growth`` (10 %) between the
two samples, when any client request failed, or when a fault could not be injected. Writes the
report as JSON (``--report``) and prints it. Blocking; Ctrl-C stops the testbed too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.workflows.drill_figures import first_remote_after, time_to_detect
from pdbridge.procgroup import cmdline, descendants, terminate_session

ROLES = [  # (pattern in the command line, role); first match wins
    (r"agents/keeper\.py", "keeper"),  # its command line holds its child's: match it first
    (r"engine serve --role prefill", "engine-prefill"),
    (r"engine serve --role decode", "engine-decode"),
    (r"kv serve", "kv-link"),
    (r"pdbridge\.cli gateway", "gateway"),
    (r"sites/remote/agent", "agent-remote"),
    (r"sites/local/agent", "agent-local"),
    (r"kv proxy", "wan-shaper"),
    (r"pdbridge\.cli serve", "console"),
    (r"gunicorn", "console"),
    (r"celery .*worker", "worker"),
    (r"celery .*beat", "beat"),
    (r"pdbridge\.cli run", "testbed"),
]


def role_of(command: str) -> str:
    for pattern, role in ROLES:
        if re.search(pattern, command):
            return role
    return "other"


def _proc_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0  # a zombie has no memory


def sample(root: int) -> dict[str, dict[str, int]]:
    """RSS (KiB), open fds and process count per role, over ``root`` and its descendants."""
    out: dict[str, dict[str, int]] = {}
    for pid in [root, *descendants(root)]:
        command = cmdline(pid)
        if not command:
            continue  # a zombie (an exited engine not yet reaped): no memory, no files
        try:
            rss, fds = _proc_rss_kib(pid), len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue  # exited meanwhile
        entry = out.setdefault(role_of(command), {"rss_kib": 0, "fds": 0, "processes": 0})
        entry["rss_kib"] += rss
        entry["fds"] += fds
        entry["processes"] += 1
    return out


def settled_sample(
    root: int, readings: int = 5, interval_s: float = 0.4
) -> dict[str, dict[str, int]]:
    """:func:`sample` taken ``readings`` times; per role the fewest fds and the median RSS.

    Under load a role's descriptors swing with the requests in flight (each remote request
    opens KV-link connections through both WAN proxies for the length of its transfer), so a
    single reading measures the traffic of that instant. A leak raises the floor, which the
    minimum still shows; the median keeps one allocation burst out of the RSS."""
    taken = []
    for i in range(readings):
        if i:
            time.sleep(interval_s)
        taken.append(sample(root))
    out: dict[str, dict[str, int]] = {}
    for role in set().union(*taken):
        seen = [t[role] for t in taken if role in t]
        rss = sorted(entry["rss_kib"] for entry in seen)
        out[role] = {
            "rss_kib": rss[len(rss) // 2],
            "fds": min(entry["fds"] for entry in seen),
            "processes": max(entry["processes"] for entry in seen),
        }
    return out


def growth(
    start: dict[str, dict[str, int]],
    end: dict[str, dict[str, int]],
    limit: float,
    fd_slack: int = 0,
) -> list[str]:
    """Roles whose RSS or fds grew by more than ``limit`` (a fraction); one line each. fds
    must also grow by more than ``fd_slack``: a role holding 16 descriptors opens two more
    with a keep-alive connection or two, which is not a leak."""
    problems = []
    for role, before in sorted(start.items()):
        after = end.get(role)
        if after is None:
            problems.append(f"{role}: gone at the end")
            continue
        for key in ("rss_kib", "fds"):
            grew = after[key] - before[key]
            if key == "fds" and grew <= fd_slack:
                continue
            if before[key] and grew / before[key] > limit:
                problems.append(f"{role}: {key} {before[key]} -> {after[key]}")
    return problems


def _agent_fault(ready: dict[str, Any], kind: str, target: str, seconds: float) -> Any:
    from agents.client import AgentClient
    from grpc_kv.tls import TLSConfig

    pki = Path(ready["var_dir"]) / "pki"
    tls = TLSConfig(
        ca_file=Path(ready["ca"]),
        cert_file=pki / "nodes" / "orchestrator.pem",
        key_file=pki / "nodes" / "orchestrator-key.pem",
        server_name="localhost",
    )

    async def go() -> Any:
        async with AgentClient(ready["agents"]["remote"], tls) as agent:
            return await agent.inject_fault(kind, target, seconds, {})

    return asyncio.run(go())


def _say(message: str) -> None:
    print(f"[pdbridge soak] {message}", flush=True)


def _wait_ready(
    testbed: subprocess.Popen[bytes], ready_file: Path, log: Path, timeout: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not ready_file.exists():
        if testbed.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the testbed did not come up: {log.read_text()[-3000:]}")
        time.sleep(1)
    return dict(json.loads(ready_file.read_text()))


def soak(
    args: argparse.Namespace, testbed: subprocess.Popen[bytes], out_dir: Path
) -> dict[str, Any]:
    """Load, faults and samples against a started testbed; returns the report."""
    ready = _wait_ready(
        testbed, out_dir / "ready.json", out_dir / "testbed.log", args.start_timeout
    )
    _say(f"testbed up: {ready['gateway_url']}; load for {args.duration_s:.0f} s")
    records, summary = out_dir / "requests.jsonl", out_dir / "load-summary.json"
    load = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
        [sys.executable, "-m", "pdbridge.cli", "loadgen", "--url", ready["gateway_url"],
         "--model", ready["served_model"], "--duration-s", str(args.duration_s),
         "--concurrency", str(args.concurrency), "--max-tokens", "8", "--timeout-s", "120",
         "--ca", ready["ca"], "--output", str(records), "--summary", str(summary)],
        stdout=subprocess.DEVNULL, stderr=(out_dir / "loadgen.log").open("wb"),
    )  # fmt: skip
    began = time.monotonic()
    # Both samples are taken under load: the end one shortly before the load stops.
    end_at = args.duration_s - min(5.0, args.duration_s * 0.05)
    plan = sorted([
        (args.warmup_s, "start"),
        (end_at, "end"),
        (args.restart_at * args.duration_s, "restart"),
        (args.cut_at * args.duration_s, "cut"),
        *((t, "tick") for t in _ticks(args.sample_every_s, end_at)),
    ])  # fmt: skip
    # RSS per role over the whole soak: a leak climbs with time, a first use of a code path
    # (the restart, the cut) is one step; the start/end comparison alone cannot tell them.
    series: list[dict[str, Any]] = []
    samples: dict[str, Any] = {}
    faults: list[dict[str, Any]] = []
    errors: list[str] = []
    child = f"dep{ready['deployment_id']}-prefill"
    for at, action in plan:
        time.sleep(max(0.0, began + at - time.monotonic()))
        try:
            if action == "tick":
                taken = sample(ready["pid"])
                series.append({"t": round(time.monotonic() - began, 1),
                               "rss_kib": {r: e["rss_kib"] for r, e in sorted(taken.items())}})  # fmt: skip
            elif action == "end":
                samples["end"] = settled_sample(ready["pid"])
            elif action == "start":
                samples["start"] = settled_sample(ready["pid"])
                _say(
                    f"warm-up over: sampled {sum(r['processes'] for r in samples['start'].values())} processes"
                )
            elif action == "restart":
                _agent_fault(ready, "engine_restart", child, 5)
                faults.append(
                    {
                        "kind": "engine_restart",
                        "target": child,
                        "at_s": round(time.monotonic() - began, 1),
                        "at_epoch": time.time(),
                    }
                )
                _say(f"remote restart: {child} killed, the agent brings it back")
            else:
                _agent_fault(ready, "link_cut", "local", args.cut_s)
                faults.append({"kind": "link_cut", "target": "local", "at_s": round(time.monotonic() - began, 1),
                               "at_epoch": time.time(), "duration_s": args.cut_s})  # fmt: skip
                _say(f"link cut for {args.cut_s:.0f} s")
        except Exception as exc:  # any failure to act is a soak failure, reported
            errors.append(f"{action}: {exc}")
    load.wait(args.duration_s + 300)
    load_summary = json.loads(summary.read_text()) if summary.exists() else {}
    problems = growth(
        samples.get("start", {}), samples.get("end", {}), args.max_growth, args.fd_slack
    )
    answered = _records(records)
    for fault in faults:
        fault.update(recovery(answered, fault))
    if load.returncode != 0:
        errors.append(f"loadgen exited {load.returncode}")
    if load_summary.get("failed", 1) != 0:
        errors.append(f"{load_summary.get('failed', 'unknown')} client requests failed")
    return {
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "faults": faults,
        "requests": load_summary,
        "processes": samples,
        "rss_series": series,
        "growth_limit": args.max_growth,
        "fd_slack": args.fd_slack,
        "growth": problems,
        "errors": errors,
        "passed": not problems and not errors,
    }


def _ticks(every_s: float, until_s: float) -> list[float]:
    """The moments of the periodic RSS samples (none when ``every_s`` is 0)."""
    if every_s <= 0:
        return []
    return [every_s * n for n in range(1, int(until_s // every_s) + 1)]


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def recovery(records: list[dict[str, Any]], fault: dict[str, Any]) -> dict[str, Any]:
    """How the traffic took one fault, from the load generator's records (the drill report's
    definitions, orchestrator/workflows/drill_figures.py): seconds from injection to the first
    answer served by the fallback (``detect_s``), from the fault clearing to the first request
    served remotely again (``recover_s``; a restart clears when the engine serves again, so
    it counts from the kill), and the requests started in between by path and how many failed."""
    injected = fault["at_epoch"]
    cleared = injected + fault.get("duration_s", 0.0)
    remote_again = first_remote_after(records, cleared)
    until = remote_again if remote_again is not None else float("inf")
    between = [r for r in records if injected <= r["start"] < until]
    by_path: dict[str, int] = {}
    for r in between:
        by_path[r["path"] or "none"] = by_path.get(r["path"] or "none", 0) + 1
    return {
        "detect_s": time_to_detect(records, injected),
        "recover_s": None if remote_again is None else round(remote_again - cleared, 3),
        "until_remote_by_path": by_path,
        "until_remote_failed": sum(1 for r in between if r["outcome"] != "ok"),
    }


def _print(report: dict[str, Any]) -> None:
    req = report["requests"]
    _say(
        f"requests: {req.get('requests')} by path {req.get('by_path')} by outcome {req.get('by_outcome')}"
    )
    for fault in report["faults"]:
        _say(
            f"{fault['kind']} at {fault['at_s']} s: fallback after {fault.get('detect_s')} s, "
            f"remote again {fault.get('recover_s')} s after it cleared; requests until then "
            f"{fault.get('until_remote_by_path')}, {fault.get('until_remote_failed')} failed"
        )
    start, end = report["processes"].get("start", {}), report["processes"].get("end", {})
    print(
        f"  {'role':16} {'procs':>5} {'RSS MiB start':>14} {'end':>8} {'fds start':>10} {'end':>6}"
    )
    for role in sorted(set(start) | set(end)):
        a, b = start.get(role, {}), end.get(role, {})
        print(f"  {role:16} {b.get('processes', 0):>5} {a.get('rss_kib', 0) / 1024:>14.1f} "
              f"{b.get('rss_kib', 0) / 1024:>8.1f} {a.get('fds', 0):>10} {b.get('fds', 0):>6}")  # fmt: skip
    grown = [line.split(":", 1)[0] for line in report["growth"]]
    for role in grown:
        points = [
            f"{p['t']:.0f}s {p['rss_kib'].get(role, 0) / 1024:.1f}" for p in report["rss_series"]
        ]
        _say(f"{role} RSS MiB over time: " + ", ".join(points))
    for line in report["growth"] + report["errors"]:
        _say(f"FAIL: {line}")
    _say("passed" if report["passed"] else "failed")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdbridge soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument(
        "--warmup-s", type=float, default=None, help="default: 10 %% of the duration"
    )
    parser.add_argument("--restart-at", type=float, default=0.3, help="fraction of the duration")
    parser.add_argument("--cut-at", type=float, default=0.6, help="fraction of the duration")
    parser.add_argument("--cut-s", type=float, default=10.0, help="how long the WAN stays cut")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-growth", type=float, default=0.10, help="allowed RSS/fd growth")
    parser.add_argument(
        "--fd-slack", type=int, default=5, help="fd growth per role that never counts as a leak"
    )
    parser.add_argument(
        "--sample-every-s", type=float, default=30.0, help="RSS series interval (0: none)"
    )
    parser.add_argument("--model", default="qwen3-next")
    parser.add_argument("--var-dir", default="var/soak")
    parser.add_argument("--report", default="", help="default: VAR_DIR/report.json")
    parser.add_argument("--start-timeout", type=float, default=1200.0)
    parser.add_argument(
        "--netns", action="store_true", help="the testbed's sites in network namespaces (root)"
    )
    args = parser.parse_args(argv)
    if args.duration_s <= 0:
        parser.error("--duration-s: must be positive")
    if args.warmup_s is None:
        args.warmup_s = args.duration_s * 0.1
    if not 0 <= args.warmup_s < min(args.restart_at, args.cut_at) * args.duration_s:
        parser.error("--warmup-s: must end before the restart and the cut")
    out_dir = Path(args.var_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("ready.json", "requests.jsonl", "load-summary.json"):
        (out_dir / stale).unlink(missing_ok=True)
    with (out_dir / "testbed.log").open("wb") as log:
        testbed = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
            [sys.executable, "-m", "pdbridge.cli", "run", "--port", "0", "--gateway-port", "0",
             "--model", args.model, "--var-dir", str(out_dir / "testbed"),
             "--ready-file", str(out_dir / "ready.json"), *(["--netns"] if args.netns else [])],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        report = soak(args, testbed, out_dir)
    except (RuntimeError, KeyboardInterrupt) as exc:
        _say(f"failed: {exc or 'interrupted'}")
        return 1
    finally:
        if not terminate_session(testbed):
            _say("the testbed overran its shutdown grace and was killed")
    report_path = Path(args.report) if args.report else out_dir / "report.json"
    report_path.write_text(json.dumps(report, indent=2))
    _print(report)
    _say(f"report: {report_path}")
    return 0 if report["passed"] else 1

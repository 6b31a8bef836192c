"""Take the README's overview screenshot, and docs/console.md's page screenshots beside it
(``PAGES``: alerts, nodes, links, a link, traces, a trace, rollouts, the drill form, prices),
from a real testbed run.

    .venv/bin/python scripts/overview_screenshot.py [--out docs/img/overview.png]

Brings up the one-command testbed (``pdbridge run``: console, worker, beat, two agents, the
engines, the kv-link and the gateway behind a shaped WAN), sends demo traffic through the
gateway with ``pdbridge loadgen`` (a log-normal prompt-length mix, so both the remote and the
local path carry requests), waits until the console has recorded the gateway's metrics, logs
in as the admin the testbed created and screenshots the overview page with Playwright driving
Debian's Chromium (``/usr/bin/chromium``, headless; ``PDBRIDGE_CHROMIUM`` overrides). Then it
stops the testbed with SIGTERM, as Ctrl-C would. Blocking; takes a few minutes (the deploy run
and the canary come first). Exits non-zero, with the testbed's log tail, when any stage fails.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("PDBRIDGE_CHROMIUM", "/usr/bin/chromium")


def _say(message: str) -> None:
    print(f"[overview-screenshot] {message}", flush=True)


def _wait_ready(proc: subprocess.Popen[bytes], ready: Path, log: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the testbed exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the testbed was not up in {timeout} s:\n{log.read_text()[-4000:]}")
        time.sleep(1)
    endpoints: dict = json.loads(ready.read_text())
    return endpoints


def _admin_password(log: Path) -> str:
    match = re.search(r"login:\s+admin / (\S+)", log.read_text())
    if match is None:
        raise RuntimeError("the testbed printed no admin password (was the database reused?)")
    return match.group(1)


def _start_loadgen(endpoints: dict, seconds: float, work: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "pdbridge.cli", "loadgen",
        "--url", endpoints["gateway_url"], "--model", endpoints["served_model"],
        "--ca", endpoints["ca"], "--duration-s", str(seconds), "--concurrency", "4",
        "--max-tokens", "8", "--output", str(work / "loadgen.jsonl"),
        "--summary", str(work / "loadgen-summary.json"),
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL)  # noqa: S603


#: The console pages docs/console.md shows, beside the overview: (path, file in docs/img/).
PAGES = [
    ("/alerts/", "alerts.png"),
    ("/nodes/", "nodes.png"),
    ("/links/", "links.png"),
    ("/traces/", "traces.png"),
    ("/rollouts/", "rollouts.png"),
    ("/drills/new/", "drill-form.png"),
    ("/tidal/prices/", "tidal-prices.png"),
]


def _pages(page: object, base: str) -> list[tuple[str, str]]:
    """``PAGES`` plus the first link's page, the newest remote trace's (its legs across both
    sites) and the first log that trace links to (its request's lines, read through the
    agent), each found on the page before it."""
    found = list(PAGES)
    for listing, pattern, name in (
        ("/links/", r'href="(/links/\d+/)"', "link.png"),
        ("/traces/?path=remote", r'href="(/traces/\d+/)"', "trace.png"),
        (None, r'class="log-link" href="(/nodes/\d+/logs/[^"]+)"', "node-log.png"),
    ):
        page.goto(f"{base}{listing or found[-1][0]}")  # type: ignore[attr-defined]
        match = re.search(pattern, page.content())  # type: ignore[attr-defined]
        if match:
            found.append((html.unescape(match.group(1)), name))
    return found


def _screenshot(endpoints: dict, password: str, out: Path, settle_s: float) -> None:
    from playwright.sync_api import sync_playwright

    base = endpoints["console_url"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            # The testbed's console presents a certificate of the testbed's own CA.
            context = browser.new_context(
                viewport={"width": 1440, "height": 900}, ignore_https_errors=True
            )
            page = context.new_page()
            page.goto(f"{base}/login/?next=/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", password)
            page.click("button[type=submit]")
            page.wait_for_url(f"{base}/")
            # The gateway's metrics reach the console on the beat's 30 s scrape, as rates
            # between two scrapes: reload (while traffic still flows) until the deployment
            # shows a path mix, or give up after settle_s and take what is there.
            deadline = time.monotonic() + settle_s
            while (
                "no traffic recorded" in page.inner_text("#deployments")
                and time.monotonic() < deadline
            ):
                time.sleep(5)
                page.reload()
            page.wait_for_load_state("networkidle")
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
            for path, name in _pages(page, base):
                page.goto(f"{base}{path}")
                page.wait_for_load_state("networkidle")
                page.screenshot(path=str(out.parent / name), full_page=True)
                _say(f"wrote {out.parent / name}")
        finally:
            browser.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "overview.png")
    parser.add_argument("--traffic-s", type=float, default=150.0, help="seconds of loadgen traffic")
    parser.add_argument(
        "--settle-s", type=float, default=120.0, help="wait for metrics (< traffic)"
    )
    parser.add_argument("--up-timeout-s", type=float, default=1200.0)
    args = parser.parse_args(argv)
    if not Path(CHROMIUM).exists():
        _say(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
        return 2
    with tempfile.TemporaryDirectory(prefix="pdbridge-screenshot-") as tmp:
        work = Path(tmp)
        log = work / "testbed.log"
        ready = work / "ready.json"
        _say(f"starting the testbed (log: {log})")
        with log.open("wb") as out:
            proc = subprocess.Popen(  # noqa: S603 - fixed argv
                [sys.executable, "-m", "pdbridge.cli", "run", "--port", "0",
                 "--gateway-port", "0", "--var-dir", str(work / "var"), "--ready-file", str(ready)],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            endpoints = _wait_ready(proc, ready, log, args.up_timeout_s)
            _say(f"up: console {endpoints['console_url']}, gateway {endpoints['gateway_url']}")
            # Traffic flows while the screenshot is taken: once it stops, the next scrape
            # records a rate of zero and the path mix is empty again.
            loadgen = _start_loadgen(endpoints, args.traffic_s, work)
            try:
                _screenshot(endpoints, _admin_password(log), args.out, args.settle_s)
            finally:
                loadgen.wait(args.traffic_s + 300)
            summary = json.loads((work / "loadgen-summary.json").read_text())
            _say(f"traffic: {json.dumps(summary)[:400]}")
            _say(f"wrote {args.out}")
        except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
            _say(f"failed: {exc}")
            return 1
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            _say(f"testbed stopped (exit {proc.returncode})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Drill report figures from load records and marks, and the verdict against criteria."""

from __future__ import annotations

import pytest

from console.drills.choices import STEPS
from console.drills.criteria import evaluate
from orchestrator.workflows import workflow_module, workflow_steps
from orchestrator.workflows.drill_figures import figures


def rec(start, path, outcome="ok", ttft=0.1, total=0.2, status=200):
    return {"index": 0, "start": start, "path": path, "outcome": outcome, "ttft_s": ttft,
            "total_s": total, "status": status, "prompt_tokens": 100, "completion_tokens": 4,
            "error": "" if outcome == "ok" else "boom"}  # fmt: skip


RECORDS = [
    rec(100.0, "remote", ttft=0.2),
    rec(101.0, "local", ttft=0.1),
    rec(102.0, "remote", ttft=0.4),
    # fault injected at 103: a request sent at 102.9 waits for the prefill timeout, falls back
    rec(102.9, "fallback", ttft=1.6, total=1.7),
    rec(104.0, "fallback", ttft=0.3),
    rec(105.0, "fallback", ttft=0.5),
    # restored at 106; first remote again at 107.5
    rec(106.2, "fallback", ttft=0.3),
    rec(107.5, "remote", ttft=0.2),
    rec(108.0, "remote", outcome="stream_error", ttft=None),
]


def _figures(**over):
    args = {"load_started_at": 100.0, "injected_at": 103.0, "restored_at": 106.0,
            "breaker": {"ejections": 1}, "verification": {"ok": True}, **over}  # fmt: skip
    return figures(RECORDS, **args)


def test_windows_paths_and_outcomes():
    data = _figures()

    assert data["requests"] == {
        "before": {"remote/ok": 2, "local/ok": 1, "fallback/ok": 1},
        "during": {"fallback/ok": 2},
        "after": {"fallback/ok": 1, "remote/ok": 1, "remote/stream_error": 1},
    }
    assert data["total_requests"] == 9
    assert data["failed_requests"] == 1
    assert data["failures"] == [
        {"t": 8.0, "status": 200, "path": "remote", "outcome": "stream_error", "error": "boom"}
    ]


def test_detect_recover_and_ttft_by_window():
    data = _figures()

    assert data["time_to_detect_s"] == 1.3  # 104.0 + 0.3 - 103 beats 102.9 + 1.6
    assert data["time_to_recover_s"] == 1.5  # 107.5 - 106
    assert data["ttft"]["during"]["fallback"] == {"p50": 0.3, "p99": 0.5, "n": 2}
    assert data["ttft"]["before"]["remote"] == {"p50": 0.2, "p99": 0.4, "n": 2}
    assert data["timeline"]["marks"] == {"injected": 3.0, "restored": 6.0, "recovered": 7.5}
    assert data["timeline"]["rows"][0] == [0.0, "remote", "ok", 0.2, 0.2, 100, ""]
    assert len(data["timeline"]["rows"]) == 9


def test_no_recovery_when_nothing_went_remote_after_restore():
    data = figures(RECORDS[:7], load_started_at=100.0, injected_at=103.0, restored_at=106.0,
                   breaker={}, verification={})  # fmt: skip

    assert data["time_to_recover_s"] is None
    assert data["timeline"]["marks"]["recovered"] is None


def test_verdict_passes_only_when_every_criterion_holds():
    data = _figures()
    rows = {r["criterion"]: r for r in evaluate({"max_failed_requests": 1}, data)}

    assert all(r["passed"] for r in rows.values()), rows
    assert set(rows) == {
        "max_failed_requests", "max_time_to_recover_s", "require_fallback",
        "require_breaker_open", "require_recovery", "require_verification",
    }  # fmt: skip

    strict = {r["criterion"]: r["passed"] for r in evaluate({}, data)}
    assert strict["max_failed_requests"] is False  # one stream error, default limit 0


@pytest.mark.parametrize(
    ("over", "criteria", "failing"),
    [
        ({"breaker": {"ejections": 0}}, {}, "require_breaker_open"),
        ({"verification": {"ok": False}}, {}, "require_verification"),
        ({}, {"max_time_to_recover_s": 1.0}, "max_time_to_recover_s"),
        ({}, {"max_time_to_detect_s": 1.0}, "max_time_to_detect_s"),
    ],
)
def test_each_criterion_can_fail(over, criteria, failing):
    rows = evaluate({"max_failed_requests": 1, **criteria}, _figures(**over))

    assert [r["criterion"] for r in rows if not r["passed"]] == [failing]


def test_no_fallback_during_the_fault_fails_require_fallback():
    data = figures([rec(104.0, "remote")], load_started_at=100.0, injected_at=103.0,
                   restored_at=106.0, breaker={"ejections": 1}, verification={"ok": True})  # fmt: skip

    failing = [r["criterion"] for r in evaluate({}, data) if not r["passed"]]

    assert failing == ["max_time_to_recover_s", "require_fallback", "require_recovery"]


def test_both_drill_workflows_have_the_steps_the_console_creates():
    assert workflow_steps("drill_link_cut") == STEPS
    assert workflow_steps("drill_remote_restart") == STEPS
    assert workflow_module("drill_link_cut").on_failure is not None


def test_verification_needs_a_remote_sample_that_matched():
    from orchestrator.workflows.drill_figures import verification_verdict

    remote = {"length": 256, "path": "remote", "match": True}
    local = {"length": 64, "path": "local", "match": True}

    assert verification_verdict([local, remote]) == {
        "ok": True,
        "remote_compared": 1,
        "prompts": [local, remote],
    }
    assert verification_verdict([local])["ok"] is False  # only local: the path was not checked
    assert verification_verdict([{**remote, "match": False}, local])["ok"] is False
    assert verification_verdict([])["ok"] is False


def test_a_drill_of_every_site_needs_its_sample_during_the_fault_served_by_the_fallback():
    from orchestrator.workflows.drill_figures import verification_verdict

    remote = {"length": 256, "path": "remote", "match": True}
    fell_back = {"length": 256, "path": "fallback", "match": True}

    verdict = verification_verdict([remote], fell_back)
    assert (verdict["ok"], verdict["fallback_compared"], verdict["during"]) == (True, 1, fell_back)
    # Served remote while every site was faulted: the fallback was not exercised.
    assert verification_verdict([remote], remote)["ok"] is False
    assert verification_verdict([remote], {**fell_back, "match": False})["ok"] is False
    # One site of two faulted: the other site may serve it.
    one_site = verification_verdict([remote], remote, every_site=False)
    assert (one_site["ok"], one_site["fallback_compared"]) == (True, 0)
    assert (
        verification_verdict([remote], {**remote, "match": False}, every_site=False)["ok"] is False
    )


def srec(start, site, failover_from="", path="remote", outcome="ok", ttft=0.1):
    return {**rec(start, path, outcome=outcome, ttft=ttft), "site": site,
            "failover_from": failover_from}  # fmt: skip


# Two prefill sites; east is cut at 103 and restored at 106.
SITE_RECORDS = [
    srec(100.0, "east"),
    srec(101.0, "west"),
    # the first request after the cut fails over from east to west, the next ones go west
    srec(103.2, "west", failover_from="east", ttft=0.6),
    srec(104.0, "west"),
    srec(104.5, "", path="fallback", ttft=0.4),
    srec(105.0, "west"),
    # restored at 106: west first, east again at 107
    srec(106.5, "west"),
    srec(107.0, "east"),
]


def _site_figures(records=SITE_RECORDS):
    return figures(records, load_started_at=100.0, injected_at=103.0, restored_at=106.0,
                   breaker={"ejections": 1}, verification={"ok": True}, site="east",
                   prefill_sites=["east", "west"])  # fmt: skip


def test_a_drill_of_one_site_counts_remote_answers_by_site_and_failovers():
    data = _site_figures()

    assert data["sites"]["faulted"] == "east"
    assert data["sites"]["prefill_sites"] == ["east", "west"]
    assert data["sites"]["served"] == {
        "before": {"east": 1, "west": 1},
        "during": {"west": 3},
        "after": {"west": 1, "east": 1},
    }
    assert data["sites"]["failovers"] == {"before": {}, "during": {"east->west": 1}, "after": {}}
    assert data["sites"]["failover_ttft"] == {"p50": 0.6, "p99": 0.6, "max": 0.6, "n": 1}
    assert data["time_to_detect_s"] == 0.8  # 103.2 + 0.6 - 103: the failover, not the fallback
    assert data["time_to_recover_s"] == 1.0  # 107.0 - 106: back at east, not at west (106.5)
    assert data["timeline"]["rows"][1][-1] == "west"


def test_the_verdict_of_a_drill_of_one_site_asks_for_failover_not_fallback():
    from console.drills.criteria import merged_criteria

    data = _site_figures()
    rows = {r["criterion"]: r for r in evaluate(merged_criteria({}, "east"), data)}

    assert "require_fallback" not in rows
    assert rows["require_failover"] == {
        "criterion": "require_failover", "limit": True, "value": {"west": 3}, "passed": True,
    }  # fmt: skip
    assert all(r["passed"] for r in rows.values()), rows
    handful = evaluate(merged_criteria({"max_fallback_requests": 0}, "east"), data)
    assert [r["criterion"] for r in handful if not r["passed"]] == ["max_fallback_requests"]


def test_no_other_site_serving_during_the_fault_fails_require_failover():
    records = [r for r in SITE_RECORDS if not (103 <= r["start"] < 106 and r["site"] == "west")]
    data = _site_figures(records)

    rows = evaluate({"require_failover": True}, data)

    assert [r["criterion"] for r in rows if not r["passed"]] == ["require_failover"]


def test_an_unreachable_gateway_is_a_failed_sample_not_a_failed_step():
    import socket

    from orchestrator.workflows.drill import verification_sample
    from orchestrator.workflows.drill_figures import verification_verdict

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    row = verification_sample({"model": "tiny", "gateway_url": url, "decode_url": url}, 64, 1)

    assert (row["path"], row["match"]) == ("", False)
    assert "Connection refused" in row["error"]
    assert verification_verdict([row])["ok"] is False


def test_answers_without_token_ids_are_a_failed_sample_not_a_match():
    """An engine that returns no token ids (vLLM before 0.10.2, or not asked) leaves nothing
    to compare: equal empty lists once passed such a sample as verified."""
    import http.server
    import json
    import threading

    from orchestrator.workflows.drill import verification_sample

    asked: list[dict] = []

    class Engine(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            asked.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = json.dumps({"choices": [{"text": " a b", "token_ids": None}],
                               "usage": {"prompt_tokens": 64, "completion_tokens": 2}}).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        row = verification_sample({"model": "tiny", "gateway_url": url, "decode_url": url}, 64, 1)
    finally:
        server.shutdown()
        server.server_close()

    assert row["match"] is False
    assert "no token ids in the gateway and decode answer" in row["error"]
    assert all(body["return_token_ids"] is True for body in asked)

"""The figures of a drill report, computed from the load generator's records and the moments the
workflow marked. Pure functions, called by the drill workflow's ``recovery`` and ``report`` steps.

Windows are by request start: ``before`` the fault was injected, ``during`` (injected .. the
agent lifted it), ``after``. Time to detect: injection -> first token of the first answer served
by the fallback path (a drill of one site: or failed over from that site). Time to recover: the
fault lifted -> start of the first request served successfully on the remote path again (a
drill of one site: prefilled at that site again).
"""

from __future__ import annotations

from typing import Any

from agents.loadgen import quantile

WINDOWS = ("before", "during", "after")
MAX_TIMELINE_ROWS = 5000
MAX_FAILURES = 50


def window(start: float, injected_at: float, restored_at: float) -> str:
    if start < injected_at:
        return "before"
    return "during" if start < restored_at else "after"


def first_remote_after(records: list[dict[str, Any]], since: float, site: str = "") -> float | None:
    """Start of the first successful remote-path request that started at or after ``since``
    (prefilled at ``site``, when given)."""
    starts = [
        r["start"]
        for r in records
        if r["path"] == "remote"
        and r["outcome"] == "ok"
        and r["start"] >= since
        and (not site or r.get("site") == site)
    ]
    return min(starts) if starts else None


def _detected(r: dict[str, Any], site: str) -> bool:
    return r["path"] == "fallback" or bool(site and r.get("failover_from") == site)


def time_to_detect(
    records: list[dict[str, Any]], injected_at: float, site: str = ""
) -> float | None:
    moments = [
        r["start"] + (r["ttft_s"] if r["ttft_s"] is not None else r["total_s"] or 0.0)
        for r in records
        if _detected(r, site) and r["start"] + (r["total_s"] or 0.0) >= injected_at
    ]
    return round(max(0.0, min(moments) - injected_at), 3) if moments else None


def by_site(
    records: list[dict[str, Any]],
    injected_at: float,
    restored_at: float,
    site: str,
    prefill_sites: list[str],
) -> dict[str, Any]:
    """Remote answers by prefill site and window, failovers (``from->to``) by window, and the
    TTFT of failed-over answers: where the traffic went while ``site`` was faulted."""
    served: dict[str, dict[str, int]] = {w: {} for w in WINDOWS}
    failovers: dict[str, dict[str, int]] = {w: {} for w in WINDOWS}
    failover_ttfts: list[float] = []
    for r in records:
        w = window(r["start"], injected_at, restored_at)
        if r["path"] == "remote" and r["outcome"] == "ok" and r.get("site"):
            served[w][r["site"]] = served[w].get(r["site"], 0) + 1
        if r.get("failover_from"):
            key = f"{r['failover_from']}->{r.get('site') or r['path']}"
            failovers[w][key] = failovers[w].get(key, 0) + 1
            if r["outcome"] == "ok" and r["ttft_s"] is not None:
                failover_ttfts.append(r["ttft_s"])
    return {
        "faulted": site,
        "prefill_sites": list(prefill_sites),
        "served": served,
        "failovers": failovers,
        "failover_ttft": {
            "p50": _r(quantile(failover_ttfts, 0.5)),
            "p99": _r(quantile(failover_ttfts, 0.99)),
            "max": _r(max(failover_ttfts, default=None)),
            "n": len(failover_ttfts),
        },
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def figures(
    records: list[dict[str, Any]],
    *,
    load_started_at: float,
    injected_at: float,
    restored_at: float,
    breaker: dict[str, Any],
    verification: dict[str, Any],
    site: str = "",
    prefill_sites: list[str] | None = None,
) -> dict[str, Any]:
    """Everything ``console.drills.services.drill_report_complete`` stores. ``site``: the one
    prefill site faulted ("" : every one)."""
    requests: dict[str, dict[str, int]] = {w: {} for w in WINDOWS}
    ttfts: dict[str, dict[str, list[float]]] = {w: {} for w in WINDOWS}
    for r in records:
        w = window(r["start"], injected_at, restored_at)
        key = f"{r['path'] or 'none'}/{r['outcome']}"
        requests[w][key] = requests[w].get(key, 0) + 1
        if r["outcome"] == "ok" and r["ttft_s"] is not None:
            ttfts[w].setdefault("all", []).append(r["ttft_s"])
            ttfts[w].setdefault(r["path"], []).append(r["ttft_s"])
    ttft = {
        w: {
            path: {"p50": _r(quantile(v, 0.5)), "p99": _r(quantile(v, 0.99)), "n": len(v)}
            for path, v in sorted(ttfts[w].items())
        }
        for w in WINDOWS
    }
    failed = [r for r in records if r["outcome"] != "ok"]
    recovered = first_remote_after(records, restored_at, site)
    ordered = sorted(records, key=lambda r: r["start"])
    step = max(1, len(ordered) // MAX_TIMELINE_ROWS + (len(ordered) % MAX_TIMELINE_ROWS > 0))
    rows = [
        [
            round(r["start"] - load_started_at, 3),
            r["path"],
            r["outcome"],
            _r(r["ttft_s"]),
            _r(r["total_s"]),
            r["prompt_tokens"],
            r.get("site", ""),
        ]
        for r in ordered[::step]
    ]
    return {
        "requests": requests,
        "total_requests": len(records),
        "failed_requests": len(failed),
        "failures": [
            {
                "t": round(r["start"] - load_started_at, 3),
                "status": r["status"],
                "path": r["path"],
                "outcome": r["outcome"],
                "error": r["error"],
            }
            for r in failed[:MAX_FAILURES]
        ],
        "ttft": ttft,
        "time_to_detect_s": time_to_detect(records, injected_at, site),
        "time_to_recover_s": None if recovered is None else round(recovered - restored_at, 3),
        "breaker": breaker,
        "verification": verification,
        "timeline": {
            "columns": ["t", "path", "outcome", "ttft_s", "total_s", "prompt_tokens", "site"],
            "marks": {
                "injected": round(injected_at - load_started_at, 3),
                "restored": round(restored_at - load_started_at, 3),
                "recovered": None if recovered is None else round(recovered - load_started_at, 3),
            },
            "sampled_every": step,
            "rows": rows,
        },
        "sites": by_site(records, injected_at, restored_at, site, prefill_sites or []),
    }


def verification_verdict(
    rows: list[dict[str, Any]], during: dict[str, Any] | None = None, *, every_site: bool = True
) -> dict[str, Any]:
    """The ``verify`` step's evidence: ``ok`` only when every sample matched its local run
    *and* at least one of them was served by the remote path (a drill whose samples all went
    local has not verified the path it drilled); ``remote_compared`` counts those.

    ``during`` is the sample sent while the fault was on: it must match too, and when the
    drill faulted every prefill site it must have been served by the fallback
    (``fallback_compared``); with one site faulted another site may serve it instead."""
    remote = sum(1 for r in rows if r.get("path") == "remote" and r.get("match"))
    ok = bool(rows) and all(r.get("match") for r in rows) and remote > 0
    verdict: dict[str, Any] = {"ok": ok, "remote_compared": remote, "prompts": rows}
    reasons = [_row_problem(r) for r in rows if not r.get("match")]
    if not rows:
        reasons.append("no verification sample was taken")
    elif remote == 0 and not reasons:
        served = ", ".join(f"{r.get('length')} chars {r.get('path') or 'no path'}" for r in rows)
        reasons.append(
            f"no verification sample went remote ({served}{_threshold_note(rows, '; ')}): the "
            "remote path was not verified"
        )
    if during is not None:
        fell_back = during.get("path") == "fallback" and bool(during.get("match"))
        during_ok = bool(during.get("match")) and (fell_back or not every_site)
        verdict.update(ok=ok and during_ok, during=during, fallback_compared=int(fell_back))
        if not during.get("match"):
            reasons.append("during the fault: " + _row_problem(during))
        elif not during_ok:
            reasons.append(
                f"the sample sent during the fault was served {during.get('path') or 'no path'},"
                f" not by the fallback{_threshold_note([during], ' (')}"
            )
    if reasons:
        verdict["reason"] = "; ".join(reasons)
    return verdict


def _row_problem(row: dict[str, Any]) -> str:
    """Why one sample row did not match, in words."""
    where = f"the {row.get('length')}-char sample ({row.get('path') or 'no path'})"
    if row.get("error"):
        return f"{where} failed: {row['error']}"
    return f"{where} differed from the decode engine's own answer at {row.get('divergence')}"


def _threshold_note(rows: list[dict[str, Any]], lead: str) -> str:
    """The gateway's threshold when the samples were sent ("" when they did not record it),
    after ``lead`` ("; " inside brackets, " (" to open them)."""
    seen = [r["threshold"] for r in rows if r.get("threshold") is not None]
    if not seen:
        return ""
    note = f"the gateway's threshold then: {max(seen):g} tokens"
    return f"{lead}{note}" + (")" if lead == " (" else "")

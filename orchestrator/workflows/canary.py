"""``canary``: raises a deployment's remote share along its rollout plan (default
1 -> 10 -> 50 -> 100 %), one run step per plan step (``share_<percent>``).

Each step sets the share (a new config version the gateways pick up at their next poll),
then holds by scheduled re-checks — no sleeping worker — until the plan's minimum duration has
passed and at least the minimum number of requests went the remote way. Each re-check scrapes
the gateways, records the figures as telemetry samples of the deployment, and once the hold is
over evaluates the gates on the traffic of this step only: remote TTFT p50 / p99 against the
local path's, the remote path's success rate, and link utilisation. Pass -> next step. Fail ->
remote share back to 0 % at once, and the run ends ``rolled_back`` with the failing gate in the
evidence.

Pause (``params.paused``, set through the console) and an active kill switch hold the step:
nothing advances, and the hold restarts when they clear. Operator edits win: before it acts,
each call checks whether someone else changed the remote share since the canary's own last
write (``flows.canary_share_guard``; the canary's writes record their config version, so they
never count). If so the canary pauses itself with the reason (``params.pause_reason`` and the
step's ``share_changed`` evidence) and leaves the share as the operator set it; a step raising
the share checks again under the deployment's row lock as it writes, and a step whose gates
passed checks again before it ends. Abort is a console service (share 0 % and cancel). The
kill switch itself is independent: it acts on the data plane directly and the canary never
touches it. Runs in a Celery worker; gateway unreachable -> the step keeps re-checking until
``max_hold_s``, then rolls back.
"""

from __future__ import annotations

import time
from typing import Any

from console.deployments import flows
from console.deployments.config import build_config
from console.deployments.models import Deployment
from console.runs.models import WorkflowRun
from console.telemetry.services import samples_record_many
from orchestrator import agentops
from orchestrator.steps import Done, RollBack, Step, StepContext, StepResult, Wait
from orchestrator.workflows import gateway_metrics as gm

DEFAULT_RECHECK_S = 5.0


def _plan_step(ctx: StepContext) -> dict[str, Any]:
    plan = ctx.params["plan"]
    return next(
        s for s in plan["steps"] if flows.canary_step_name(s["share_percent"]) == ctx.step_name
    )


def _scrape_all(deployment: Deployment) -> dict[str, dict[str, Any]]:
    """Every gateway's figures by node (one that does not answer is left out)."""
    config = build_config(deployment)
    ssl_ctx = agentops.http_ssl_context()
    out = {}
    for target in agentops.targets(config, "decode"):
        try:
            out[target.hostname] = agentops.run_async(
                gm.scrape(agentops.gateway_url(target), ssl_ctx)
            )
        except Exception as exc:  # an unreachable gateway is a finding, not a crash
            out[target.hostname] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _merge_window(
    start: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Traffic of all gateways since the step started, summed."""
    requests: dict[str, float] = {}
    buckets: dict[str, dict[str, float]] = {}
    for node, figures in now.items():
        if "error" in figures:
            continue
        before = start.get(node)
        if before is None or "error" in before:
            before = gm.parse("")
        win = gm.window(before, figures)
        for key, value in win["requests"].items():
            requests[key] = requests.get(key, 0.0) + value
        for path, b in win["ttft_buckets"].items():
            into = buckets.setdefault(path, {})
            for le, count in b.items():
                into[le] = into.get(le, 0.0) + count
    return {"requests": requests, "ttft_buckets": buckets}


def _lifetime_local(now: dict[str, dict[str, Any]]) -> dict[str, float]:
    into: dict[str, float] = {}
    for figures in now.values():
        for le, count in figures.get("ttft_buckets", {}).get("local", {}).items():
            into[le] = into.get(le, 0.0) + count
    return into


def figures(start: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """What the gates judge: this step's remote traffic against the local path's."""
    win = _merge_window(start, now)
    remote_total, remote_ok = gm.requests_on(win, "remote")
    fallback_total, _ = gm.requests_on(win, "fallback")
    local_total, _ = gm.requests_on(win, "local")
    local_buckets = win["ttft_buckets"].get("local", {})
    local_source = "step"
    if not local_buckets or max(local_buckets.values(), default=0) <= 0:
        local_buckets, local_source = _lifetime_local(now), "gateway lifetime"
    remote_buckets = win["ttft_buckets"].get("remote", {})
    attempted = remote_total + fallback_total
    utilization = [
        u for f in now.values() if "error" not in f for u in f["link_utilization"].values()
    ]
    return {
        "remote_requests": remote_total,
        "remote_ok": remote_ok,
        "fallback_requests": fallback_total,
        "local_requests": local_total,
        "success_rate": round(remote_ok / attempted, 4) if attempted else None,
        "ttft_p50_remote_s": gm.quantile(remote_buckets, 0.5),
        "ttft_p99_remote_s": gm.quantile(remote_buckets, 0.99),
        "ttft_p50_local_s": gm.quantile(local_buckets, 0.5),
        "ttft_p99_local_s": gm.quantile(local_buckets, 0.99),
        "local_baseline": local_source,
        "link_utilization_max": max(utilization) if utilization else 0.0,
        "gateways_unreachable": sorted(n for n, f in now.items() if "error" in f),
    }


def evaluate_gates(fig: dict[str, Any], gates: dict[str, float]) -> list[dict[str, Any]]:
    """One row per gate: name, value, limit, passed (a gate without data to judge passes
    with a note, except the success rate, which needs remote requests)."""
    rows = []
    for q in ("p50", "p99"):
        remote, local = fig[f"ttft_{q}_remote_s"], fig[f"ttft_{q}_local_s"]
        limit = gates[f"ttft_{q}_ratio"]
        if remote is None or not local:
            rows.append(
                {
                    "gate": f"ttft_{q}_ratio",
                    "value": None,
                    "limit": limit,
                    "passed": True,
                    "note": "no data",
                }
            )
            continue
        ratio = round(remote / local, 3)
        rows.append(
            {"gate": f"ttft_{q}_ratio", "value": ratio, "limit": limit, "passed": ratio <= limit}
        )
    rate = fig["success_rate"]
    rows.append(
        {
            "gate": "success_rate",
            "value": rate,
            "limit": gates["success_rate_min"],
            "passed": rate is not None and rate >= gates["success_rate_min"],
        }
    )
    util = fig["link_utilization_max"]
    rows.append(
        {
            "gate": "link_utilization",
            "value": util,
            "limit": gates["link_utilization_max"],
            "passed": util <= gates["link_utilization_max"],
        }
    )
    return rows


def _record(deployment: Deployment, fig: dict[str, Any], share: int) -> None:
    values = {
        f"canary.{k}": float(v)
        for k, v in fig.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    samples_record_many(subject=deployment, values=values, labels={"share_percent": share})


def share_step(ctx: StepContext) -> StepResult:
    """One plan step: set the share, hold, gate (see the module docstring)."""
    deployment = Deployment.objects.get(pk=int(ctx.target_id))
    step = _plan_step(ctx)
    share = int(step["share_percent"])
    recheck = float(ctx.params.get("recheck_s", DEFAULT_RECHECK_S))
    run = WorkflowRun.objects.get(pk=ctx.run_id)
    evidence = dict(ctx.evidence)
    held = (
        "paused" if run.params.get("paused") else ("kill switch" if deployment.kill_switch else "")
    )
    if held:
        return _hold(evidence, held, recheck)
    change = flows.canary_share_guard(run_id=ctx.run_id, deployment=deployment)
    if change is not None:
        return _paused_by_change(ctx, evidence, change, recheck)
    now_scrape = _scrape_all(deployment)
    if "started_at" not in evidence:
        change = flows.canary_set_share(
            run_id=ctx.run_id,
            deployment=deployment,
            percent=share,
            reason=f"canary #{ctx.run_id}: {share} %",
        )
        if change is not None:  # an edit landed between the check above and this write
            return _paused_by_change(ctx, evidence, change, recheck)
        evidence.update(
            share_percent=share,
            started_at=time.time(),
            start=now_scrape,
            held="",
            hold={"min_duration_s": step["min_duration_s"], "min_requests": step["min_requests"]},
        )
        return Wait(recheck, evidence)
    fig = figures(evidence["start"], now_scrape)
    _record(deployment, fig, share)
    elapsed = time.time() - evidence["started_at"]
    evidence.update(figures=fig, elapsed_s=round(elapsed, 1), checks=evidence.get("checks", 0) + 1)
    attempted = fig["remote_requests"] + fig["fallback_requests"]
    if elapsed < step["min_duration_s"] or attempted < step["min_requests"]:
        max_hold = float(ctx.params.get("max_hold_s", 3600))
        if elapsed > max_hold:
            return _roll_back(
                ctx,
                deployment,
                evidence,
                {
                    "gate": "hold",
                    "value": attempted,
                    "limit": step["min_requests"],
                    "passed": False,
                },
            )
        return Wait(recheck, evidence)
    gates = evaluate_gates(fig, ctx.params["plan"]["gates"])
    evidence["gates"] = gates
    failed = next((g for g in gates if not g["passed"]), None)
    if failed is not None:
        return _roll_back(ctx, deployment, evidence, failed)
    change = flows.canary_share_guard(run_id=ctx.run_id, deployment=deployment)
    if change is not None:  # edited while this call scraped: the gates judged another share
        evidence.pop("gates", None)
        return _paused_by_change(ctx, evidence, change, recheck)
    evidence.pop("start", None)  # the raw scrape served its purpose; keep the evidence small
    return Done(evidence)


def _hold(evidence: dict[str, Any], held: str, recheck: float) -> Wait:
    """Hold: nothing is written, and the step's clock restarts when the hold ends."""
    evidence.pop("started_at", None)
    evidence.pop("start", None)
    evidence["held"] = held
    return Wait(recheck, evidence)


def _paused_by_change(
    ctx: StepContext, evidence: dict[str, Any], change: flows.ShareChange, recheck: float
) -> Wait:
    """Someone else changed the share: the canary paused itself (``canary_share_guard``) and
    holds with the change in its evidence; the operator's value stays."""
    evidence["share_changed"] = change.as_dict()
    ctx.log(change.describe())
    return _hold(evidence, "paused", recheck)


def _roll_back(
    ctx: StepContext, deployment: Deployment, evidence: dict[str, Any], gate: dict[str, Any]
) -> RollBack:
    # The safe state wins over any edit: no guard.
    flows.canary_set_share(
        run_id=ctx.run_id,
        deployment=deployment,
        percent=0,
        reason=f"canary #{ctx.run_id} rolled back: gate {gate['gate']}",
        guard=False,
    )
    evidence.pop("start", None)
    evidence["failed_gate"] = gate
    evidence["remote_share_percent"] = 0
    return RollBack(
        f"gate {gate['gate']} failed: {gate['value']} against limit {gate['limit']}", evidence
    )


def on_failure(ctx: StepContext) -> None:
    """Safe state after an unexpected failure (a crash, not a gate): remote share 0 %."""
    deployment = Deployment.objects.get(pk=int(ctx.target_id))
    flows.canary_set_share(
        run_id=ctx.run_id,
        deployment=deployment,
        percent=0,
        reason=f"canary #{ctx.run_id} failed",
        guard=False,
    )


# Any ``share_<n>`` step runs ``share_step``: the run's own step list comes from the rollout
# plan copied into its params at start.
STEPS = [Step(flows.canary_step_name(n), share_step) for n in range(1, 101)]

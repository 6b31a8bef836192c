"""Drills: ``drill_link_cut`` and ``drill_remote_restart`` (one module, two registry names; the
run's ``kind`` param picks the fault).

Steps: synthetic load starts in the background -> baseline window -> the fault is injected
through the agents *with an expiry* (the agents lift it by themselves even if this workflow
dies) -> fault window -> wait until the agents report it lifted (and, for a restart, the
engines running) -> wait for traffic back on the remote path, then the after window -> stop and
collect the load -> a verification sample through the gateway against the decode engine alone
-> the report. Every window is a ``Wait`` re-check; no worker sleeps through a fault.

Inputs are the run's params, resolved by ``console.drills.services.drill_params`` when the drill
started. The load generator's files live in ``<VAR_DIR>/drills/run-<id>-<created>/`` (a
database started afresh never meets an earlier run's files) on the worker that started it, so a drill's steps expect workers sharing that directory (one worker host, or the
site queue of the local site).
"""

from __future__ import annotations

import json
import time
from typing import Any

from agents.engines.verify import compare, make_prompt, token_ids_of
from agents.loadgen import read_records
from console.drills import services as drill_services
from console.drills.choices import STEPS as STEP_NAMES
from console.runs.models import StepRun
from orchestrator import drillops
from orchestrator.steps import Done, Fail, Step, StepContext, StepResult, Wait
from orchestrator.workflows.drill_figures import (
    figures,
    first_remote_after,
    verification_verdict,
)

#: How often windows with a condition (restore, recovery, load collection) are re-checked.
RECHECK_S = 0.5
#: Extra time the load generator may run past the planned windows before it stops by itself.
LOAD_SLACK_S = 60.0
#: A fault the agent still reports this long after its expiry is cleared explicitly.
CLEAR_AFTER_S = 5.0


def _load(ctx: StepContext) -> dict[str, Any]:
    return ctx.previous["start_load"]


def start_load(ctx: StepContext) -> StepResult:
    p = ctx.params
    duration = p["baseline_s"] + p["fault_s"] + p["recover_timeout_s"] + p["after_s"] + LOAD_SLACK_S
    ejections = drillops.breaker_ejections(p["gateway_url"])
    info = drillops.start_load(drillops.run_key(ctx.run_id), p, duration)
    ctx.log(f"load generator pid {info['pid']} for at most {duration:.0f} s")
    return Done({**info, "breaker_ejections_before": ejections})


def baseline(ctx: StepContext) -> StepResult:
    load = _load(ctx)
    due = load["started_at"] + ctx.params["baseline_s"]
    if time.time() < due:
        return Wait(due - time.time())
    records = read_records_of(load)
    if not records:
        return Fail(f"no request completed in the {ctx.params['baseline_s']} s baseline window")
    paths: dict[str, int] = {}
    for r in records:
        paths[r["path"] or "none"] = paths.get(r["path"] or "none", 0) + 1
    return Done({"requests": len(records), "by_path": paths})


def read_records_of(load: dict[str, Any]) -> list[dict[str, Any]]:
    from pathlib import Path

    return read_records(Path(load["output"]))


def _placements(p: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Where the fault may go, in order: ``faults`` (a link cut: the decode side's agents
    towards each prefill site), then each of ``fault_alternatives`` (the prefill side's agents
    towards the decode site: the testbed's fault proxy belongs to the remote agent)."""
    out = [("primary", list(p["faults"]))]
    out += [(f"a{n}", list(specs)) for n, specs in enumerate(p.get("fault_alternatives") or [])]
    return out


def _spec(fault: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """The agent call spec of an injected fault: its own record (which names its agent), or
    for a record from before records did, the params' fault on that node."""
    if fault.get("agent"):
        return {k: fault[k] for k in ("agent", "node", "kind", "target")}
    return {f["node"]: f for f in p["faults"]}[fault["node"]]


def _signals(p: dict[str, Any]) -> dict[str, Any] | None:
    """The gateway's own signals (:func:`drillops.gateway_signals`), None when its metrics
    cannot be read."""
    try:
        return drillops.gateway_signals(p["gateway_url"])
    except OSError:
        return None


def inject_fault(ctx: StepContext) -> StepResult:
    """Inject the fault on the first placement whose agents can all act on it; an agent that
    cannot (``FAILED_PRECONDITION``: no proxy or route for that peer) moves the fault to the
    next placement, after clearing what this one already injected. The gateway's signals
    just before are kept: the fault window waits for them to move."""
    p = ctx.params
    key = drillops.run_key(ctx.run_id)
    folder = drillops.run_dir(key)
    marks, before = folder / "injected_at", folder / "signals_before.json"
    if not marks.exists():  # the first attempt's moment survives a re-execution
        before.write_text(json.dumps(_signals(p)))
        marks.write_text(repr(time.time()))
    injected_at = float(marks.read_text())
    signals = json.loads(before.read_text()) if before.exists() else None
    refused: list[str] = []
    for label, specs in _placements(p):
        if not specs:
            continue
        faults: list[dict[str, Any]] = []
        try:
            for index, fault in enumerate(specs):
                suffix = str(index) if label == "primary" else f"{label}-{index}"
                faults.append(
                    drillops.inject(fault, p["fault_s"], request_id=f"drill-{key}-{suffix}")
                )
                ctx.log(f"{fault['kind']} on {fault['node']} -> {fault['target']}")
        except Exception as exc:
            if not drillops.cannot_act(exc):
                raise
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            refused.append(f"{fault['node']} ({fault['kind']} -> {fault['target']}): {detail}")
            ctx.log(f"{fault['node']} cannot act on {fault['target']}: {detail}")
            for done in faults:
                drillops.clear(_spec(done, p), done["id"])
            continue
        return Done(
            {
                "injected_at": injected_at,
                "expires_at": injected_at + p["fault_s"],
                "faults": faults,
                "placement": label,
                "refused": refused,
                "signals_before": signals,
            }
        )
    return Fail("no agent could inject the fault: " + "; ".join(refused))


def fault_window(ctx: StepContext) -> StepResult:
    """The fault's planned length; first, one verification sample sent while the fault is on
    (for a drill of every prefill site it can only be served by the fallback, the path the
    drill exists to keep working; the ``verify`` step judges it)."""
    p = ctx.params
    injected = ctx.previous["inject_fault"]
    due = injected["expires_at"]
    sample = ctx.evidence.get("sample")
    seen = ctx.evidence.get("fault_seen")
    if sample is None and seen is None:
        seen = _fault_seen(ctx, injected)
        if seen is None:
            # A sample sent before the gateway has noticed the fault is served the old way
            # (seen: a scheduled drill's sample 1 s after injection, the gateway's breaker 4 s)
            # and proves nothing about the path the drill exists to test. Wait for the
            # gateway's own signal, at most half the window.
            if time.time() < injected["injected_at"] + p["fault_s"] / 2:
                return Wait(RECHECK_S)
            seen = "not seen by the gateway within half the fault window; sampled anyway"
        ctx.log(f"fault in effect: {seen}")
    if sample is None:
        # Its own prompt (seed): the after-fault sample must not find this one's prefix cached.
        sample = verification_sample(p, p["verify_prompts"][0], seed=-ctx.run_id)
        ctx.log(f"sample during the fault: {sample['path'] or 'no path'}, match {sample['match']}")
    if time.time() < due:
        return Wait(due - time.time(), {"sample": sample, "fault_seen": seen})
    return Done({"ended_at": time.time(), "sample": sample, "fault_seen": seen})


def _fault_seen(ctx: StepContext, injected: dict[str, Any]) -> str | None:
    """The gateway's own sign that it has seen the fault (None: not yet): since the
    injection, a breaker ejected, a fallback for a failure or -- a drill of one site -- a
    request failed over from that site. Without the gateway's metrics, the load's: a request
    started after the injection served by the fallback or (one site) by another site."""
    p = ctx.params
    site = p.get("site") or ""
    before = injected.get("signals_before")
    now = _signals(p) if before else None
    if before and now:
        if now["ejections"] > before["ejections"]:
            return "the gateway's breaker opened"
        if site:
            moved = now["failovers"].get(site, 0) - before["failovers"].get(site, 0)
            if moved > 0:
                return f"the gateway failed over from {site}"
        if now["fallbacks"] > before["fallbacks"]:
            return "the gateway fell back to local prefill"
        return None
    since = injected["injected_at"]
    for r in read_records_of(_load(ctx)):
        if r["start"] >= since and r["outcome"] == "ok":
            if r["path"] == "fallback":
                return "the load got a fallback answer"
            if site and r["path"] == "remote" and r.get("site") != site:
                return "the load got an answer from another site"
    return None


def restore(ctx: StepContext) -> StepResult:
    """Until every agent reports the fault lifted (and, for a restart, the child running)."""
    p, injected = ctx.params, ctx.previous["inject_fault"]
    pending = []
    for fault in injected["faults"]:
        spec = _spec(fault, p)
        view = drillops.agent_view(spec)
        if fault["id"] in view["faults"]:
            if time.time() > injected["expires_at"] + CLEAR_AFTER_S:
                drillops.clear(spec, fault["id"])  # belt and braces: expiry should have done it
                ctx.log(f"cleared {fault['id']} on {fault['node']} explicitly")
            pending.append(f"{fault['node']}: fault {fault['id']} active")
        elif spec["kind"] == "engine_kill" and view["children"].get(spec["target"]) != "running":
            pending.append(
                f"{fault['node']}: {spec['target']} is {view['children'].get(spec['target'])}"
            )
    if pending:
        if time.time() > injected["expires_at"] + p["recover_timeout_s"]:
            return Fail("not restored: " + "; ".join(pending))
        return Wait(RECHECK_S, {"pending": pending})
    return Done({"restored_at": injected["expires_at"], "confirmed_at": time.time()})


def recovery(ctx: StepContext) -> StepResult:
    """Until traffic is back on the remote path -- at the faulted site, for a drill of one
    site -- (or the timeout), then the after window."""
    p = ctx.params
    restored_at = ctx.previous["restore"]["restored_at"]
    # A drill of one site waits for traffic back at that site, not on any remote path.
    recovered_at = ctx.evidence.get("recovered_at") or first_remote_after(
        read_records_of(_load(ctx)), restored_at, p.get("site") or ""
    )
    now = time.time()
    if recovered_at is None:
        if now > restored_at + p["recover_timeout_s"]:
            ctx.log("traffic did not return to the remote path before the timeout")
            return Done({"recovered_at": None})
        return Wait(RECHECK_S)
    due = recovered_at + p["after_s"]
    if now < due:
        return Wait(due - now, {"recovered_at": recovered_at})
    return Done({"recovered_at": recovered_at})


def collect_load(ctx: StepContext) -> StepResult:
    load = _load(ctx)
    drillops.stop_load(load)
    asked = ctx.evidence.get("stop_requested_at") or time.time()
    from pathlib import Path

    summary = Path(load["summary"])
    if not summary.exists():
        if time.time() < asked + 120:
            return Wait(RECHECK_S, {"stop_requested_at": asked})
        killed = drillops.kill_load(load)
        ctx.log(f"load generator did not finish in 120 s; SIGTERM sent: {killed}")
    ejections = drillops.breaker_ejections(ctx.params["gateway_url"])
    return Done(
        {
            "summary": json.loads(summary.read_text()) if summary.exists() else None,
            "breaker_ejections_after": ejections,
        }
    )


#: A sample prompt is this much above the threshold the gateway applies when it is sent (one
#: re-tuning step, 1.25x, plus some tokens), so that a rise meanwhile still routes it remote.
SAMPLE_MARGIN = 1.25
SAMPLE_MARGIN_TOKENS = 16


def sample_length(p: dict[str, Any], length: int, threshold: float | None) -> int:
    """The prompt length (characters) of a verification sample of at least ``length``, sized
    above the gateway's effective ``threshold`` (tokens; None: unknown, ``length`` as is) by
    the margin, within the model's context (``p["sample"]``; None: the operator chose the
    lengths, ``length`` as is)."""
    sizing = p.get("sample")
    if not sizing or threshold is None:  # lengths an operator chose, or nothing to size from
        return length
    per_token = float(sizing.get("chars_per_token") or 1)
    tokens = int(threshold * SAMPLE_MARGIN) + SAMPLE_MARGIN_TOKENS
    max_len = sizing.get("max_model_len")
    if max_len:
        tokens = min(tokens, int(max_len) - 16)
    return max(length, int(tokens * per_token))


def verification_sample(p: dict[str, Any], length: int, seed: int) -> dict[str, Any]:
    """One prompt of at least ``length`` through the gateway vs the decode engine alone,
    greedy, token for token: the row ``verify`` judges (path served, match, divergence, and
    the gateway's threshold when it was sent). The prompt is sized above the threshold the
    gateway applies now (:func:`sample_length`): its re-tuner may have raised it up to 4x the
    configured one."""
    signals = _signals(p)
    threshold = signals["threshold"] if signals else None
    length = sample_length(p, length, threshold)
    row = _sample(p, length, seed)
    row["threshold"] = threshold
    return row


def _sample(p: dict[str, Any], length: int, seed: int) -> dict[str, Any]:
    body = {
        "model": p["model"],
        "prompt": make_prompt(length, seed=seed),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        # vLLM returns token ids only when asked; the reference engine always does.
        "return_token_ids": True,
    }
    try:
        status, path, through = drillops.post_json(p["gateway_url"] + "/v1/completions", body)
        local_status, _, local = drillops.post_json(p["decode_url"] + "/v1/completions", body)
    except OSError as exc:  # unreachable or timed out: a failed sample, not a failed step
        return {"length": length, "path": "", "match": False, "error": str(exc)}
    if status != 200 or local_status != 200:
        return {"length": length, "path": path, "match": False,
                "error": f"gateway {status}, decode {local_status}"}  # fmt: skip
    missing = [n for n, r in (("gateway", through), ("decode", local)) if not token_ids_of(r)]
    if missing:  # nothing compared is not a match
        return {"length": length, "path": path, "match": False,
                "error": f"no token ids in the {' and '.join(missing)} answer"}  # fmt: skip
    match, tokens, digests, divergence = compare(local, through)
    return {"length": length, "path": path, "match": match, "tokens": tokens,
            "logits": digests, "divergence": str(divergence) if divergence else None}  # fmt: skip


def verify(ctx: StepContext) -> StepResult:
    """Sample prompts through the gateway vs the decode engine alone, token for token, with
    the sample taken during the fault."""
    p = ctx.params
    rows = [verification_sample(p, length, seed=ctx.run_id) for length in p["verify_prompts"]]
    during = ctx.previous["fault_window"].get("sample")
    return Done(verification_verdict(rows, during, every_site=not p.get("site")))


def report(ctx: StepContext) -> StepResult:
    load, prev = _load(ctx), ctx.previous
    before = load["breaker_ejections_before"]
    after = prev["collect_load"]["breaker_ejections_after"]
    data = figures(
        read_records_of(load),
        load_started_at=load["started_at"],
        injected_at=prev["inject_fault"]["injected_at"],
        restored_at=prev["restore"]["restored_at"],
        breaker={"ejections": after - before, "before": before, "after": after},
        verification=prev["verify"],
        site=ctx.params.get("site") or "",
        prefill_sites=ctx.params.get("prefill_sites") or [],
    )
    saved = drill_services.drill_report_complete(run_id=ctx.run_id, figures=data)
    return Done(
        {
            "report": saved.pk,
            "state": saved.state,
            "requests": data["total_requests"],
            "failed": data["failed_requests"],
            "time_to_detect_s": data["time_to_detect_s"],
            "time_to_recover_s": data["time_to_recover_s"],
        }
    )


def on_failure(ctx: StepContext) -> None:
    """Stop the load, lift the faults now (they would expire anyway), mark the report aborted."""
    load = ctx.previous.get("start_load")
    if load:
        drillops.stop_load(load)
    injected = ctx.previous.get("inject_fault") or (
        ctx.evidence if ctx.step_name == "inject_fault" else {}
    )
    for fault in injected.get("faults", []):
        try:
            drillops.clear(_spec(fault, ctx.params), fault["id"])
        except Exception as exc:  # the agent's expiry lifts it regardless
            ctx.log(f"clear {fault['id']} failed: {exc}")
    # The report says why, not only where: the failed step's own error, as the run page has it.
    cause = (
        StepRun.objects.filter(run_id=ctx.run_id, name=ctx.step_name)
        .values_list("error", flat=True)
        .first()
    )
    error = f"step {ctx.step_name} failed: {cause}" if cause else f"step {ctx.step_name} failed"
    drill_services.drill_report_abort(run_id=ctx.run_id, error=error)


STEPS = [
    Step("start_load", start_load),
    Step("baseline", baseline),
    Step("inject_fault", inject_fault),
    Step("fault_window", fault_window),
    Step("restore", restore),
    Step("recovery", recovery),
    Step("collect_load", collect_load),
    Step("verify", verify),
    Step("report", report),
]
if [s.name for s in STEPS] != STEP_NAMES:  # the console creates the step rows by these names
    raise ImportError("orchestrator.workflows.drill: STEPS differ from console.drills.choices")

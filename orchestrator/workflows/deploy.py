"""``deploy``: the deployment guide's eight verified steps, each recording its evidence.

1 capacity baseline · 2 WAN baseline · 3 remote prefill pool · 4 local decode pool · 5 KV link ·
6 gateway (remote share 0 %) · 7 token-by-token verification · 8 canary (hand-over).

Safe state: remote share 0 %. Every step until 7 keeps the share at 0 % (step 6 sets it before
the gateway starts), and ``on_failure`` sets it again and marks the deployment ``failed`` — so a
failed run leaves the data plane serving everything locally, and ``retry`` from the failed step
(or an earlier one) picks up where it stopped: steps re-check the world, launches with the same
settings are no-ops on the agents. Runs in a Celery worker (blocking agent and HTTP calls with
deadlines); failures surface as the step's ``Fail`` with evidence.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
from django.utils import timezone

from console.deployments import flows
from console.deployments.choices import DeploymentState
from console.deployments.config import build_config
from console.deployments.models import Deployment
from console.inventory.models import Link
from console.inventory.services import link_update
from console.planner.kvsize import ArchitectureError, kv_bytes
from console.runs.choices import RunState
from console.runs.models import WorkflowRun
from orchestrator import agentops, linkops
from orchestrator.agentops import Target
from orchestrator.steps import Done, Fail, RollBack, Step, StepContext, StepResult, Wait
from orchestrator.workflows.gateway_metrics import scrape

DEFAULT_VERIFY_LENGTHS = [40, 200, 700]
#: Top-k logprobs step 7 compares at each step on vLLM engines (they have no logits digests).
VLLM_VERIFY_LOGPROBS = 5
#: Seconds step 6 waits for every gateway to serve the deployment's config version.
DEFAULT_GATEWAY_READY_S = 120.0
#: Rounds of step 2's probes before a transient failure fails the step: a first connection
#: across a busy WAN (or a busy testbed machine) that times out once is not a broken link.
PROBE_ATTEMPTS = 4
#: Wait before the second round; doubles for each next one (1, 2, 4 s).
PROBE_BACKOFF_S = 1.0
#: What a probe that may well pass next time fails with: the agent could not reach the
#: peer's kv-link in time (``UNAVAILABLE``, the probe's own connect or deadline), or the call
#: to the agent ran out (``DEADLINE_EXCEEDED``).
PROBE_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def _deployment(ctx: StepContext) -> Deployment:
    return Deployment.objects.select_related("model").get(pk=int(ctx.target_id))


def _config(deployment: Deployment) -> dict[str, Any]:
    return build_config(deployment)


def _deploying(deployment: Deployment) -> None:
    """Every step runs with the deployment in ``deploying`` (a retry after a failure moves it
    back from ``failed``)."""
    flows.deployment_settle(deployment=deployment, to_state=str(DeploymentState.DEPLOYING))


def _local_only(deployment: Deployment, why: str) -> None:
    flows.deployment_set_remote_share(actor=None, deployment=deployment, percent=0, reason=why)


# -- 1 -----------------------------------------------------------------------------------
def capacity_baseline(ctx: StepContext) -> StepResult:
    """KV bytes per request at the deployment's lengths, the WAN bandwidth that needs, the
    instance counts and the threshold; written to the deployment as its baseline."""
    deployment = _deployment(ctx)
    _deploying(deployment)
    _local_only(deployment, "deploy: local only until the canary")
    config = _config(deployment)
    threshold = deployment.remote_prefill_threshold_tokens
    lengths = sorted(
        {
            int(n)
            for n in ctx.params.get("baseline_lengths", [threshold, 2 * threshold, 8 * threshold])
        }
    )
    rate = float(ctx.params.get("remote_requests_per_s", 1.0))
    try:
        per_request = {str(n): kv_bytes(deployment.model.architecture, n) for n in lengths}
    except ArchitectureError as exc:
        return Fail(f"model.architecture: {exc}")
    worst = max(per_request.values())
    baseline = {
        "threshold_tokens": threshold,
        "kv_bytes_per_request": per_request,
        "remote_requests_per_s": rate,
        "bandwidth_needed_mbit_s": round(worst * rate * 8 / 1e6, 3),
        "instances": {
            "prefill": sum(len(p["nodes"]) for p in config["pools"]["prefill"]),
            "decode": len(config["pools"]["decode"]["nodes"]),
        },
        "config_version": deployment.version,
        "measured_at": timezone.now().isoformat(),
    }
    flows.deployment_set_baseline(actor=None, deployment=deployment, baseline=baseline)
    return Done(baseline)


# -- 2 -----------------------------------------------------------------------------------
def _kv_link(
    ctx: StepContext, deployment: Deployment, config: dict[str, Any], decode: Target
) -> dict[str, Any]:
    """The decode site's kv-link receiver (probe and loopback target), launched idempotently,
    admitting only the deployment's allowlist and the orchestrator (the evidence says who)."""
    launch_settings = agentops.kv_link_launch_settings(decode, config)
    name = agentops.child_name(deployment.pk, "kvlink")
    rid = agentops.request_id(ctx, decode, name, launch_settings)
    launched = agentops.launch(
        decode,
        kind="kv-link",
        name=name,
        launch_settings=launch_settings,
        deployment_id=deployment.pk,
        rid=rid,
    )
    launched["allowlist"] = agentops.allowlist_evidence("kv-link", launch_settings)
    return launched


def wan_baseline(ctx: StepContext) -> StepResult:
    """Each prefill node's agent measures bandwidth and RTT to the decode site's kv-link; the
    figures are stored on the Link between the two sites."""
    deployment = _deployment(ctx)
    _deploying(deployment)
    config = _config(deployment)
    decode = agentops.targets(config, "decode")[0]
    kvlink = _kv_link(ctx, deployment, config, decode)
    seconds = float(ctx.params.get("probe_seconds", 2.0))
    probes = []
    for target in agentops.targets(config, "prefill"):
        try:
            result = agentops.probe(
                target, decode.site, decode.kv_link_wan_address_for(target.site), seconds
            )
        except Exception as exc:
            again = probe_retry(ctx.evidence, exc)
            if again is None:
                raise
            ctx.log(f"probe from {target.hostname} failed, round {again.evidence['probe_round']}")
            return again
        result["from_site"] = target.site
        probes.append(result)
        link = Link.objects.filter(from_site__name=target.site, to_site__name=decode.site).first()
        if link is not None:
            now = timezone.now()
            link_update(
                actor=None,
                link=link,
                measured_mbit_s=result["mbit_s"],
                rtt_ms=result["rtt_ms"],
                measured_at=now,
            )
            linkops.record_samples(link, result, now)  # the link's history starts here
            result["link"] = link.pk
    if any(p["mbit_s"] <= 0 for p in probes):
        return Fail("probe measured no bandwidth", {"kv_link": kvlink, "probes": probes})
    needed = (deployment.baseline or {}).get("bandwidth_needed_mbit_s", 0)
    slowest = min(p["mbit_s"] for p in probes)
    evidence = {
        "kv_link": kvlink,
        "probes": probes,
        "probe_rounds": int(ctx.evidence.get("probe_round", 0)) + 1,
        "probe_errors": list(ctx.evidence.get("probe_errors", [])),
        "slowest_mbit_s": slowest,
        "bandwidth_needed_mbit_s": needed,
        "headroom": round(slowest / needed, 2) if needed else None,
    }
    if needed and slowest < needed:
        return Fail(
            f"WAN {slowest} Mbit/s is below the {needed} Mbit/s the baseline needs", evidence
        )
    return Done(evidence)


def probe_retry(evidence: dict[str, Any], exc: BaseException) -> Wait | None:
    """The re-check before the next round of step 2's probes after a transient failure
    (``PROBE_TRANSIENT``; ``evidence`` is the step's from its previous rounds), with backoff;
    None when the error is not transient or ``PROBE_ATTEMPTS`` rounds are spent."""
    code = getattr(exc, "code", None)
    name = getattr(code(), "name", "") if callable(code) else ""
    done = int(evidence.get("probe_round", 0)) + 1  # rounds run, this one included
    if name not in PROBE_TRANSIENT or done >= PROBE_ATTEMPTS:
        return None
    details = getattr(exc, "details", None)
    error = f"{name}: {details() if callable(details) else exc}"[:500]
    errors = [*evidence.get("probe_errors", []), error]
    return Wait(PROBE_BACKOFF_S * 2 ** (done - 1), {"probe_round": done, "probe_errors": errors})


# -- 3 and 4 -------------------------------------------------------------------------------
def _launch_pool(ctx: StepContext, deployment: Deployment, role: str) -> list[dict[str, Any]]:
    config = _config(deployment)
    kind = "prefill-engine" if role == "prefill" else "decode-engine"
    launched = []
    for target in agentops.targets(config, role):
        engine, launch_settings = agentops.engine_launch_settings(target, config)
        name = agentops.child_name(deployment.pk, role)
        rid = agentops.request_id(ctx, target, name, launch_settings)
        # The deployment id is what the node's heartbeat reports each child under: readiness
        # finds the deployment's engines (and their weights) by it.
        result = agentops.launch(
            target,
            kind=kind,
            name=name,
            engine=engine,
            launch_settings=launch_settings,
            deployment_id=deployment.pk,
            rid=rid,
        )
        result["engine_url"] = target.engine_url
        allowlist = agentops.allowlist_evidence(kind, launch_settings)
        if allowlist is not None:
            result["allowlist"] = allowlist
        launched.append(result)
    return launched


async def throughput_check(
    url: str, model: str, tokens: int, ssl_ctx: Any = None
) -> dict[str, Any]:
    """One request of ``tokens`` prompt tokens and 8 output tokens; prompt tokens per second."""
    from agents.engines.verify import make_prompt

    body = {
        "model": model,
        "prompt": make_prompt(tokens, seed=11),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body, ssl=ssl_ctx) as response:
            data = await response.json()
            status = response.status
        seconds = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status}: {str(data)[:300]}")
    prompt_tokens = int(data["usage"]["prompt_tokens"])
    return {
        "url": url,
        "prompt_tokens": prompt_tokens,
        "seconds": round(seconds, 3),
        "prompt_tokens_per_s": round(prompt_tokens / seconds, 1),
    }


def served_model(target: Target) -> str:
    """The model id the engine serves (see :attr:`Target.served_model`)."""
    return target.served_model


def remote_prefill(ctx: StepContext) -> StepResult:
    """Agents launch the prefill engines; each must be running and pass a single-instance
    throughput check (a real completion of a prompt at the threshold length)."""
    deployment = _deployment(ctx)
    _deploying(deployment)
    launched = _launch_pool(ctx, deployment, "prefill")
    tokens = max(16, min(deployment.remote_prefill_threshold_tokens, 2048))
    checks = [
        agentops.run_async(throughput_check(t.engine_url, served_model(t), tokens))
        for t in agentops.targets(_config(deployment), "prefill")
    ]
    evidence = {"engines": launched, "throughput": checks}
    bad = [e for e in launched if e["state"] != "running"]
    if bad:
        return Fail(f"engine {bad[0]['name']} on {bad[0]['node']} is {bad[0]['state']}", evidence)
    return Done(evidence)


def local_decode(ctx: StepContext) -> StepResult:
    """Agents launch the decode engines (local prefill stays on: they prefill locally whenever
    a request does not go remote); each answers a local completion."""
    deployment = _deployment(ctx)
    _deploying(deployment)
    launched = _launch_pool(ctx, deployment, "decode")
    checks = [
        agentops.run_async(throughput_check(t.engine_url, served_model(t), 64))
        for t in agentops.targets(_config(deployment), "decode")
    ]
    evidence = {
        "engines": launched,
        "local_prefill": checks,
        "fallback_to_local_prefill": deployment.fallback_to_local_prefill,
    }
    bad = [e for e in launched if e["state"] != "running"]
    if bad:
        return Fail(f"engine {bad[0]['name']} on {bad[0]['node']} is {bad[0]['state']}", evidence)
    return Done(evidence)


# -- 5 -----------------------------------------------------------------------------------
def kv_link(ctx: StepContext) -> StepResult:
    """The kv-link is up; a loopback transfer of test blocks through it verifies checksums and
    a rate within the expectation from step 2 (at least ``loopback_min_ratio`` of the probe)."""
    from grpc_kv.probe import loopback

    deployment = _deployment(ctx)
    _deploying(deployment)
    config = _config(deployment)
    decode = agentops.targets(config, "decode")[0]
    kvlink = _kv_link(ctx, deployment, config, decode)
    tls = agentops.controller_tls(decode.hostname)
    result = agentops.run_async(
        loopback(
            decode.kv_link_address,
            tls,
            blocks=int(ctx.params.get("loopback_blocks", 8)),
            block_bytes=int(ctx.params.get("loopback_block_bytes", 1 << 20)),
        )
    )
    expected = float(ctx.previous.get("wan_baseline", {}).get("slowest_mbit_s") or 0)
    ratio = float(ctx.params.get("loopback_min_ratio", 0.05))
    evidence = {
        "kv_link": kvlink,
        "loopback": result,
        "expected_mbit_s": expected,
        "min_ratio": ratio,
    }
    if not result.get("ok"):
        return Fail(f"loopback transfer failed: {result.get('error')}", evidence)
    if result.get("checksum_failures"):
        return Fail(f"{result['checksum_failures']} chunks failed their checksum", evidence)
    if expected and result["mbit_s"] < ratio * expected:
        return Fail(
            f"loopback {result['mbit_s']} Mbit/s is below {ratio} x the probed {expected} Mbit/s",
            evidence,
        )
    return Done(evidence)


# -- 6 -----------------------------------------------------------------------------------
def gateway(ctx: StepContext) -> StepResult:
    """The gateway starts on the decode node(s) with the deployment's current config snapshot
    and remote share 0 %; it must be healthy and report that version and share."""
    deployment = _deployment(ctx)
    _deploying(deployment)
    _local_only(deployment, "deploy: gateway starts local only")
    deployment.refresh_from_db()
    config = _config(deployment)
    results = []
    ssl_ctx = agentops.http_ssl_context()
    for target in agentops.targets(config, "decode"):
        name = agentops.child_name(deployment.pk, "gateway")
        launch_settings = agentops.gateway_launch_settings(target)
        # No config_version in the request: the gateway polls the console for the current one,
        # so the canary's share changes reach it without a relaunch.
        rid = agentops.request_id(ctx, target, name, launch_settings)
        launched = agentops.launch(
            target,
            kind="gateway",
            name=name,
            launch_settings=launch_settings,
            deployment_id=deployment.pk,
            rid=rid,
        )
        url = agentops.gateway_url(target)
        try:
            metrics = agentops.run_async(scrape(url, ssl_ctx))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # A gateway still starting (not listening yet, or slow on a busy host) is "not
            # applied yet", re-checked until the deadline below; the error stays in evidence.
            metrics = {}
            launched["scrape_error"] = f"{type(exc).__name__}: {exc}"
        launched.update(
            url=url,
            config_version=metrics.get("config_version"),
            remote_share=metrics.get("remote_share"),
        )
        results.append(launched)
    first_check = float(ctx.evidence.get("first_check", time.time()))
    polls = int(ctx.evidence.get("polls", 0))
    evidence = {
        "gateways": results,
        "deployment_version": deployment.version,
        "first_check": first_check,
        "polls": polls,
    }
    lagging = [r for r in results if (r["config_version"] or 0) < deployment.version]
    if lagging:
        # A deadline, not a count of re-checks: a re-check's own launch and scrape take
        # seconds on a loaded host, so 30 of them said nothing about how long it waited.
        ready_s = float(ctx.params.get("gateway_ready_s", DEFAULT_GATEWAY_READY_S))
        if time.time() - first_check < ready_s:
            return Wait(1.0, {**evidence, "polls": polls + 1})
        why = lagging[0].get("scrape_error") or f"reports version {lagging[0]['config_version']}"
        return Fail(
            f"gateway {lagging[0]['node']} did not apply version {deployment.version} "
            f"within {ready_s:g} s ({why})",
            evidence,
        )
    if any(r["remote_share"] not in (0, 0.0) for r in results):
        return Fail("gateway reports a remote share above 0 %", evidence)
    return Done(evidence)


# -- 7 -----------------------------------------------------------------------------------
def verification(ctx: StepContext) -> StepResult:
    """``pdbridge verify`` across prompt lengths for every prefill engine against the decode
    engine: remote-prefilled output must equal the local-only run token by token (and logits
    digest by digest). Any mismatch fails the run."""
    from agents.engines.verify import run_verification

    deployment = _deployment(ctx)
    _deploying(deployment)
    config = _config(deployment)
    decode = agentops.targets(config, "decode")[0]
    lengths = [int(n) for n in ctx.params.get("verify_lengths", DEFAULT_VERIFY_LENGTHS)]
    reports = []
    for target in agentops.targets(config, "prefill"):
        report = agentops.run_async(
            run_verification(
                prefill=target.engine_url,
                decode=decode.engine_url,
                model=served_model(target),
                lengths=lengths,
                max_tokens=int(ctx.params.get("verify_max_tokens", 8)),
                kv_destination=decode.kv_address_for(target.site),
                deadline_s=float(ctx.params.get("verify_deadline_s", 30)),
                kv_mode=deployment.kv_mode,
                # vLLM has no logits digests: its top-5 logprobs at each step stand in.
                logprobs=VLLM_VERIFY_LOGPROBS if target.settings.get("engine") == "vllm" else None,
                logprob_tolerance=float(ctx.params.get("verify_logprob_tolerance", 0.0)),
            )
        )
        reports.append({"prefill": target.hostname, **report})
    evidence = {
        "lengths": lengths,
        "reports": reports,
        "ok": all(r["ok"] and r["fingerprints_equal"] for r in reports),
    }
    for report in reports:
        for prompt in report["prompts"]:
            if not prompt["match"]:
                where = prompt["first_divergence"] or prompt.get("error")
                return Fail(
                    f"verification mismatch on {report['prefill']} at {prompt['length']} "
                    f"tokens: {where}",
                    evidence,
                )
        if not report["fingerprints_equal"]:
            return Fail(f"model fingerprints differ on {report['prefill']}", evidence)
    return Done(evidence)


# -- 8 -----------------------------------------------------------------------------------
def canary(ctx: StepContext) -> StepResult:
    """Hands over to the canary workflow (started once; its run id is in the evidence) and
    waits, by re-checks, for its end: succeeded -> the deployment is ``active``; rolled back
    -> this run ends rolled back too (remote share is already 0 %)."""
    deployment = _deployment(ctx)
    _deploying(deployment)  # a retry after a rolled-back canary left it failed
    run_id = ctx.evidence.get("canary_run")
    earlier: list[int] = list(ctx.evidence.get("earlier_canaries", []))
    if run_id is not None and ctx.evidence.get("execution") != ctx.execution:
        # An operator's retry of this step (a new execution): the canary it started before
        # has ended (that is why the step failed); a retry means a new canary, not its verdict.
        previous = WorkflowRun.objects.filter(pk=run_id).first()
        if previous is None or previous.state not in (RunState.PENDING, RunState.RUNNING):
            earlier.append(int(run_id))
            run_id = None
    if run_id is None:
        existing = flows.active_run(deployment, flows.CANARY_KIND)
        if existing is None:
            existing = flows.canary_start(
                actor=None, deployment=deployment, params=dict(ctx.params.get("canary", {}))
            )
        run_id = existing.pk
    run = WorkflowRun.objects.get(pk=run_id)
    evidence: dict[str, Any] = {
        "canary_run": run_id,
        "canary_state": run.state,
        "execution": ctx.execution,
    }
    if earlier:
        evidence["earlier_canaries"] = earlier
    if run.state in (RunState.PENDING, RunState.RUNNING):
        return Wait(float(ctx.params.get("recheck_s", 2.0)), evidence)
    if run.state == RunState.SUCCEEDED:
        flows.deployment_settle(deployment=deployment, to_state=str(DeploymentState.ACTIVE))
        deployment.refresh_from_db()
        evidence["remote_share_percent"] = deployment.remote_share_percent
        return Done(evidence)
    evidence["canary_error"] = run.error
    _local_only(deployment, f"deploy: canary #{run_id} {run.state}")
    flows.deployment_settle(deployment=deployment, to_state=str(DeploymentState.FAILED))
    if run.state == RunState.ROLLED_BACK:
        return RollBack(f"canary #{run_id} rolled back: {run.error}", evidence)
    return Fail(f"canary #{run_id} ended {run.state}: {run.error}", evidence)


def on_failure(ctx: StepContext) -> None:
    """Safe state: remote share 0 % (the gateways send everything local at their next poll)
    and the deployment marked ``failed``; engines stay up so a retry resumes quickly."""
    deployment = _deployment(ctx)
    _local_only(deployment, f"deploy run #{ctx.run_id} failed at {ctx.step_name}")
    flows.deployment_settle(deployment=deployment, to_state=str(DeploymentState.FAILED))


STEPS = [
    Step("capacity_baseline", capacity_baseline),
    Step("wan_baseline", wan_baseline),
    Step("remote_prefill", remote_prefill),
    Step("local_decode", local_decode),
    Step("kv_link", kv_link),
    Step("gateway", gateway),
    Step("verification", verification),
    Step("canary", canary),
]
assert [s.name for s in STEPS] == flows.DEPLOY_STEPS  # noqa: S101  (console and worker agree)

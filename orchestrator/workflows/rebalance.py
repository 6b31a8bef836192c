"""``rebalance``: carries out an approved rebalancing proposal -- converts local nodes between
the deployment's decode pool and its local prefill pool on the running fleet, not only in the
database (``console.schedules.rebalance.rebalance_apply`` starts it).

Steps (``REBALANCE_STEPS``), each re-checking the world before it acts (a step may run again
after its worker died; agent request ids derive from the step's execution):

1. **check** -- the proposal is still the one being applied, no canary runs, every node is
   still in its source pool and no pool would be left empty;
2. **drain** -- the nodes leave their source pool's rotation (``pool_set_drained``: a new config
   version); re-checked until every decode gateway applied it with no leg in flight to them, or
   ``drain_timeout_s`` passed (then the evidence says ``timed_out`` and in-flight legs of those
   nodes may fail over or fall back);
3. **stop** -- each node's old-role children stop: a decode node's engine and gateway, a prefill
   node's engine (an absent child is not called);
4. **launch** -- each node's engine starts in its new role with the destination pool's engine
   settings (a node becoming decode also gets its gateway); re-checked until the agents report
   them healthy, within ``ready_s``;
5. **join** -- the nodes move to their new pool (one config version per pool changed);
6. **verify** -- every gateway applied that version, and each moved engine answers a real
   completion; the proposal becomes ``applied``.

A failed step leaves the proposal ``failed`` (``on_failure``); the nodes stay drained out of the
old pool (never in rotation half-converted). Undo: retry the failed step from the run page, or
rejoin the node (``POST /api/pools/{id}/drain/`` with ``rejoin``) after relaunching its old
engine; a later proposal can move it back.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings

from console.deployments.config import build_config
from console.deployments.models import Deployment, Pool
from console.deployments.services import pool_set_drained
from console.inventory.models import Node
from console.schedules import rebalance
from console.schedules.choices import ProposalState
from console.schedules.models import RebalanceProposal
from console.schedules.services import canary_in_progress
from orchestrator import agentops
from orchestrator.agentops import Target
from orchestrator.steps import Done, Fail, Step, StepContext, StepResult, Wait
from orchestrator.tidalops import gateways_drained
from orchestrator.workflows.deploy import served_model, throughput_check

DEFAULT_READY_S = 120.0
RECHECK_S = 1.0
#: The agent's child kinds by pool role.
ENGINE_KIND = {"prefill": "prefill-engine", "decode": "decode-engine"}


def _proposal(ctx: StepContext) -> RebalanceProposal:
    return RebalanceProposal.objects.select_related("deployment").get(pk=ctx.params["proposal"])


def _source(deployment: Deployment, role: str) -> Pool:
    decode = Pool.objects.get(deployment=deployment, role="decode")
    if role == "decode":
        return decode
    return Pool.objects.get(deployment=deployment, role="prefill", site_id=decode.site_id)


def _node_target(node: Node, role: str, deployment: Deployment, config: dict[str, Any]) -> Target:
    """The node as a ``role`` engine host: the model's engine settings under the destination
    pool's (the decode pool's when the local prefill pool does not exist yet, as
    ``rebalance_move_nodes`` will create it with those)."""
    pool = _destination(deployment, role) or _source(deployment, "decode")
    merged = {**(config["model"].get("engine_settings") or {}), **(pool.engine_settings or {})}
    return Target(role, pool.site.name, node.hostname, node.agent_address, merged)


def _destination(deployment: Deployment, role: str) -> Pool | None:
    try:
        return _source(deployment, role)
    except Pool.DoesNotExist:
        return None


def _moves(proposal: RebalanceProposal) -> list[tuple[dict[str, Any], Node]]:
    nodes = {n.pk: n for n in Node.objects.filter(pk__in=[m["node"] for m in proposal.moves])}
    return [(m, nodes[m["node"]]) for m in proposal.moves]


def _elapsed(ctx: StepContext) -> tuple[float, float]:
    first = float(ctx.evidence.get("first_check", time.time()))
    return first, time.time() - first


# -- 1 -------------------------------------------------------------------------------------
def check(ctx: StepContext) -> StepResult:
    proposal = _proposal(ctx)
    # Failed: this run failed here before and an operator retried it.
    ours = proposal.state in (ProposalState.APPLYING, ProposalState.FAILED)
    if not ours or proposal.run_id != ctx.run_id:
        return Fail(f"proposal {proposal.pk} is {proposal.state}, not being applied by this run")
    if canary_in_progress(proposal.deployment) is not None:
        return Fail("a canary is in progress on the deployment")
    try:
        rebalance.check_moves(proposal.deployment, proposal.moves)
    except Exception as exc:  # Conflict / ValidationError: the proposal no longer applies
        return Fail(str(getattr(exc, "detail", exc)))
    return Done(
        {
            "moves": proposal.moves,
            "current_split": proposal.current_split,
            "target_split": proposal.target_split,
        }
    )


# -- 2 -------------------------------------------------------------------------------------
def drain(ctx: StepContext) -> StepResult:
    proposal = _proposal(ctx)
    deployment = proposal.deployment
    evidence = dict(ctx.evidence)
    if "version" not in evidence:
        by_pool: dict[str, list[Node]] = {}
        for move, node in _moves(proposal):
            by_pool.setdefault(move["from"], []).append(node)
        version = 0
        for role, nodes in by_pool.items():
            version = pool_set_drained(
                actor=None,
                pool=_source(deployment, role),
                drain=nodes,
                reason=f"rebalance proposal {proposal.pk}: drain {len(nodes)} {role} node(s)",
            )
        first, _ = _elapsed(ctx)
        evidence.update(version=version, first_check=first, checks=0)
        ctx.log(f"drained {', '.join(m['hostname'] for m in proposal.moves)} (v{version})")
        # Written in this step's transaction: no gateway can have it before it is recorded.
        return Wait(RECHECK_S, evidence)
    config = build_config(deployment)
    site = config["pools"]["decode"]["site"]
    answers: list[dict[str, Any]] = []
    ok = True
    for role in ("decode", "prefill"):
        hosts = [m["hostname"] for m in proposal.moves if m["from"] == role]
        if hosts:
            done, seen = gateways_drained(config, site, hosts, int(evidence["version"]), role)
            ok, answers = ok and done, answers + seen
    evidence.update(gateways=answers, checks=int(evidence.get("checks", 0)) + 1)
    _, waited = _elapsed(ctx)
    timeout_s = float(ctx.params.get("drain_timeout_s", settings.TIDAL_DRAIN_TIMEOUT_S))
    if ok:
        return Done({**evidence, "state": "applied", "waited_s": round(waited, 3)})
    if waited >= timeout_s:
        ctx.log(f"drain timed out after {waited:.0f} s: in-flight legs may fail over")
        return Done({**evidence, "state": "timed_out", "waited_s": round(waited, 3)})
    return Wait(RECHECK_S, evidence)


# -- 3 -------------------------------------------------------------------------------------
def _old_children(deployment_id: int, role: str) -> list[str]:
    names = [agentops.child_name(deployment_id, role)]
    if role == "decode":
        names.append(agentops.child_name(deployment_id, "gateway"))
    return names


def stop(ctx: StepContext) -> StepResult:
    proposal = _proposal(ctx)
    stopped = []
    for move, node in _moves(proposal):
        # Only the agent is called: its address is all the target needs.
        target = Target(move["from"], "", node.hostname, node.agent_address, {})
        for name in _old_children(proposal.deployment_id, move["from"]):
            if agentops.child_status(target, name)["state"] == "absent":
                stopped.append({"node": node.hostname, "name": name, "action": "absent"})
                continue
            rid = agentops.request_id(ctx, target, name, "stop")

            async def go(agent: Any, name: str = name, rid: str = rid) -> Any:
                return await agent.stop(name, request_id=rid)

            answer = agentops.call(target, go)
            stopped.append(
                {
                    "node": node.hostname,
                    "name": name,
                    "action": "stopped",
                    "state": answer.child.state,
                }
            )
    return Done({"children": stopped})


# -- 4 -------------------------------------------------------------------------------------
def _launch(ctx: StepContext, deployment: Deployment, target: Target, config: dict) -> list:
    name = agentops.child_name(deployment.pk, target.role)
    engine, launch_settings = agentops.engine_launch_settings(target, config)
    out = [
        agentops.launch(
            target,
            kind=ENGINE_KIND[target.role],
            name=name,
            engine=engine,
            launch_settings=launch_settings,
            deployment_id=deployment.pk,
            rid=agentops.request_id(ctx, target, name, launch_settings),
        )
    ]
    if target.role == "decode":
        gw = agentops.child_name(deployment.pk, "gateway")
        gw_settings = agentops.gateway_launch_settings(target)
        out.append(
            agentops.launch(
                target,
                kind="gateway",
                name=gw,
                launch_settings=gw_settings,
                deployment_id=deployment.pk,
                rid=agentops.request_id(ctx, target, gw, gw_settings),
            )
        )
    return out


def launch(ctx: StepContext) -> StepResult:
    proposal = _proposal(ctx)
    deployment = proposal.deployment
    config = build_config(deployment)
    first, waited = _elapsed(ctx)
    launched, unhealthy = [], []
    for move, node in _moves(proposal):
        target = _node_target(node, move["to"], deployment, config)
        for result in _launch(ctx, deployment, target, config):
            status = agentops.child_status(target, result["name"])
            result["healthy"] = status["healthy"]
            launched.append(result)
            if not status["healthy"]:
                unhealthy.append(f"{result['name']} on {node.hostname} is {status['state']}")
    evidence = {"children": launched, "first_check": first}
    if not unhealthy:
        return Done(evidence)
    ready_s = float(ctx.params.get("ready_s", DEFAULT_READY_S))
    if waited < ready_s:
        return Wait(RECHECK_S, evidence)
    return Fail(f"not healthy within {ready_s:g} s: {'; '.join(unhealthy)}", evidence)


# -- 5 -------------------------------------------------------------------------------------
def join(ctx: StepContext) -> StepResult:
    proposal = _proposal(ctx)
    version = rebalance.rebalance_move_nodes(proposal=proposal)
    ctx.log(f"moved {', '.join(m['hostname'] for m in proposal.moves)} (v{version})")
    return Done({"version": version})


# -- 6 -------------------------------------------------------------------------------------
def verify(ctx: StepContext) -> StepResult:
    from orchestrator.workflows.gateway_metrics import scrape

    proposal = _proposal(ctx)
    deployment = proposal.deployment
    config = build_config(deployment)
    version = int(ctx.previous.get("join", {}).get("version") or deployment.version)
    ssl_ctx = agentops.http_ssl_context()
    gateways = []
    for target in agentops.targets(config, "decode"):
        url = agentops.gateway_url(target)
        try:
            applied = agentops.run_async(scrape(url, ssl_ctx))["config_version"]
        except Exception as exc:  # still starting (a node that became decode): re-checked
            applied = None
            ctx.log(f"{url}: {type(exc).__name__}: {exc}")
        gateways.append({"gateway": url, "config_version": applied})
    first, waited = _elapsed(ctx)
    evidence: dict[str, Any] = {"version": version, "gateways": gateways, "first_check": first}
    lagging = [g for g in gateways if (g["config_version"] or 0) < version]
    ready_s = float(ctx.params.get("ready_s", DEFAULT_READY_S))
    if lagging:
        if waited < ready_s:
            return Wait(RECHECK_S, evidence)
        return Fail(f"gateway {lagging[0]['gateway']} did not apply v{version}", evidence)
    checks = []
    moved = {m["hostname"] for m in proposal.moves}
    for role in ("prefill", "decode"):
        for target in agentops.targets(config, role):
            if target.hostname in moved:
                check = agentops.run_async(
                    throughput_check(target.engine_url, served_model(target), 64)
                )
                checks.append({"node": target.hostname, "role": role, **check})
    evidence["engines"] = checks
    rebalance.rebalance_finish(proposal_id=proposal.pk, ok=True)
    return Done(evidence)


def on_failure(ctx: StepContext) -> None:
    """The proposal is ``failed``; drained nodes stay drained (see the module docstring)."""
    rebalance.rebalance_finish(proposal_id=int(ctx.params["proposal"]), ok=False)


STEPS = [
    Step("check", check),
    Step("drain", drain),
    Step("stop", stop),
    Step("launch", launch),
    Step("join", join),
    Step("verify", verify),
]

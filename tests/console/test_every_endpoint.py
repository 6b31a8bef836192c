"""Every API operation, listed once: the table below must name every path and method the URL
map serves under /api/ (a new endpoint without a row fails ``test_the_table_lists_every_api_
operation``). Each row is then called by every role: anonymous 401, an account without a role
and each role below the one needed 403, the needed role its success status; a read is also
answered to every role above, and a write must add to the audit log. Write operations get
hostile bodies and list operations hostile query strings (a 4xx, never a 500), and every
operation on an unknown id is a 404. Per-app tests check what the answers contain; this file
checks that nothing is left out."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from console.alerts.services import alert_rule_create, alerts_evaluate, channel_create
from console.core.models import AuditLog
from console.core.services_users import user_create
from console.drills import services as drills
from console.drills.models import DrillReport
from console.inventory.services import node_token_issue
from console.planner.services import scenario_create
from console.rollouts.services import rollout_plan_create
from console.runs import services as runs
from console.schedules.models import RebalanceProposal, SitePriceTable
from console.schedules.services import tidal_apply_hour
from console.telemetry.models import RequestTrace
from console.telemetry.services import sample_record, trace_record_batch
from tests.console.factories import (
    DENSE_ARCH,
    ModelSpecFactory,
    NodeFactory,
    SiteFactory,
    make_deployment,
    make_tidal_schedule,
    small_case_study,
)

pytestmark = pytest.mark.django_db

RANK = {"viewer": 1, "operator": 2, "admin": 3}
HUGE = "9" * 30
NOW = datetime(2026, 11, 30, 5, tzinfo=UTC)


@pytest.fixture
def w(world: Any, make_user: Any) -> Any:
    """``world`` plus one row of every other kind the API serves."""
    world.deployment.refresh_from_db()
    world.schedule = make_tidal_schedule(
        deployment=world.deployment,
        remote_site=world.remote,
        local_site=world.local,
        capacity=[1] * 24,
        local_prices=[1.0] * 24,
    )
    world.price = SitePriceTable.objects.get(site=world.local)
    world.application = tidal_apply_hour(schedule_id=world.schedule.pk, now=NOW)
    world.proposal = RebalanceProposal.objects.create(
        deployment=world.deployment, reason="endpoint test", moves=[]
    )
    world.drill = drills.drill_create(
        actor=None, name="cut", deployment=world.deployment, kind="link_cut"
    )
    world.report = drills.drill_run(actor=None, drill=world.drill)
    world.run = runs.run_create(actor=None, kind="selfcheck", steps=["database"], start=False)
    world.plan = rollout_plan_create(actor=None, name="plan")
    world.scenario = scenario_create(actor=None, name="case", body=small_case_study())
    world.sample = sample_record(subject=world.link, name="link_rtt_ms", value=1000.0, at=NOW)
    trace_record_batch(node=world.decode_node, traces=[{**_trace_doc(), "started_at": NOW}])
    world.trace = RequestTrace.objects.get()
    alerts_evaluate(now=NOW.replace(minute=1), notify=False)
    from console.alerts.models import Alert, AlertRule

    world.alert = Alert.objects.get()
    world.rule = AlertRule.objects.get(name="link-rtt-high")
    world.added_rule = alert_rule_create(  # shipped rules are turned off, not deleted (409)
        actor=None,
        name="kv-queue-old",
        layer="service",
        level="info",
        metric="kv_link_queue_bytes",
        comparison="gt",
        threshold=1e9,
    )
    world.channel = channel_create(
        actor=None, name="hook", kind="webhook", target="https://hooks.example.com/x"
    )
    world.user = user_create(
        actor=None, username="someone", password="pw-for-tests-1", role="viewer"
    )
    world.audit = AuditLog.objects.order_by("id").first()
    world.admin = APIClient()
    world.admin.force_authenticate(make_user("admin"))
    return world


def put_back(path: str, drop: tuple[str, ...] = (), unchanged: bool = True) -> Callable[[Any], Any]:
    """A PUT body: the object as the API shows it (read-only fields are ignored on input).
    ``unchanged``: storing it changes nothing, so nothing may be audited."""

    def body(w: Any) -> Any:
        data = w.admin.get(path.format(w=w)).json()
        return {k: v for k, v in data.items() if k not in drop}

    body.unchanged = unchanged and not drop  # type: ignore[attr-defined]
    return body


def failed_run(w: Any) -> None:
    """A run whose only step failed (retry's precondition) becomes ``w.run``."""
    w.run = runs.run_create(actor=None, kind="selfcheck", steps=["database"], start=False)
    claim = runs.step_claim_next(run_id=w.run.pk, worker="w", stale_after_s=30)
    runs.step_fail(step_id=claim.step_id, worker="w", error="x", evidence={})


@dataclass(frozen=True)
class Op:
    """One API operation: who may call it and what a valid call looks like."""

    path: str  # formatted with w=<the fixture above>
    role: str  # viewer | operator | admin | any (authenticated) | public | node
    status: int  # the success status for the needed role
    body: Callable[[Any], Any] | None = None
    # Sets the world up for the success call (the refused calls before it change nothing).
    before: Callable[[Any], Any] | None = None
    # Reads through a node's agent: 502 / 503 / 504 with a detail naming the agent or the
    # missing setting are its documented answers when the agent cannot be read, not crashes.
    upstream: bool = False


def _trace_doc() -> dict[str, Any]:
    return {
        "version": 1,
        "request_id": "req-every-endpoint",
        "started_at": "2026-11-30T05:00:00.000+00:00",
        "path": "local",
        "outcome": "ok",
        "total_ms": 3.5,
        "legs": [{"leg": "queue", "start_ms": 0.0, "end_ms": 0.1}],
    }


def _gateway_key(w: Any) -> None:
    from console.gatewaykeys.services import gateway_key_create

    w.gateway_key, _ = gateway_key_create(actor=None, deployment=w.deployment, name="team-w")


def _site(w: Any) -> dict[str, Any]:
    return {"name": "new-site", "role": "prefill"}


OPS: dict[tuple[str, str], Op] = {
    # core
    ("GET", "/api/"): Op("/api/", "public", 200),
    ("GET", "/api/schema/"): Op("/api/schema/", "public", 200),
    ("GET", "/api/docs/"): Op("/api/docs/", "public", 200),
    ("GET", "/api/redoc/"): Op("/api/redoc/", "public", 200),
    ("POST", "/api/auth/token/"): Op(
        "/api/auth/token/",
        "public",
        200,
        body=lambda w: {"username": "someone", "password": "pw-for-tests-1"},
    ),
    ("GET", "/api/me/"): Op("/api/me/", "any", 200),
    ("GET", "/api/audit-log/"): Op("/api/audit-log/", "viewer", 200),
    ("GET", "/api/audit-log/{id}/"): Op("/api/audit-log/{w.audit.pk}/", "viewer", 200),
    ("GET", "/api/users/"): Op("/api/users/", "admin", 200),
    ("POST", "/api/users/"): Op(
        "/api/users/",
        "admin",
        201,
        body=lambda w: {"username": "new-user", "password": "pw-for-tests-2", "role": "operator"},
    ),
    ("GET", "/api/users/{id}/"): Op("/api/users/{w.user.pk}/", "admin", 200),
    ("PUT", "/api/users/{id}/"): Op(
        "/api/users/{w.user.pk}/", "admin", 200, body=lambda w: {"role": "operator"}
    ),
    ("PATCH", "/api/users/{id}/"): Op(
        "/api/users/{w.user.pk}/", "admin", 200, body=lambda w: {"is_active": False}
    ),
    # inventory
    ("GET", "/api/sites/"): Op("/api/sites/", "viewer", 200),
    ("POST", "/api/sites/"): Op("/api/sites/", "admin", 201, body=_site),
    ("GET", "/api/sites/{id}/"): Op("/api/sites/{w.local.pk}/", "viewer", 200),
    ("PUT", "/api/sites/{id}/"): Op(
        "/api/sites/{w.local.pk}/", "admin", 200, body=put_back("/api/sites/{w.local.pk}/")
    ),
    ("PATCH", "/api/sites/{id}/"): Op(
        "/api/sites/{w.local.pk}/", "admin", 200, body=lambda w: {"region": "ap-east"}
    ),
    ("DELETE", "/api/sites/{id}/"): Op(
        "/api/sites/{w.spare.pk}/",
        "admin",
        204,
        before=lambda w: setattr(w, "spare", SiteFactory()),
    ),
    ("GET", "/api/nodes/"): Op("/api/nodes/", "viewer", 200),
    ("POST", "/api/nodes/"): Op(
        "/api/nodes/",
        "admin",
        201,
        body=lambda w: {"site": w.local.pk, "hostname": "dec-9", "agent_address": "10.0.0.9:7070"},
    ),
    ("GET", "/api/nodes/{id}/"): Op("/api/nodes/{w.decode_node.pk}/", "viewer", 200),
    # No controller identity in this suite: the answer that names it (the read itself, through
    # a real agent: tests/console/inventory/test_node_log.py).
    ("GET", "/api/nodes/{id}/logs/{child}/"): Op(
        "/api/nodes/{w.decode_node.pk}/logs/decode-engine-1/?q=req-1",
        "operator",
        503,
        upstream=True,
    ),
    ("PUT", "/api/nodes/{id}/"): Op(
        "/api/nodes/{w.decode_node.pk}/",
        "admin",
        200,
        body=put_back("/api/nodes/{w.decode_node.pk}/"),
    ),
    ("PATCH", "/api/nodes/{id}/"): Op(
        "/api/nodes/{w.decode_node.pk}/", "admin", 200, body=lambda w: {"accelerator_count": 4}
    ),
    ("DELETE", "/api/nodes/{id}/"): Op(
        "/api/nodes/{w.spare.pk}/",
        "admin",
        204,
        before=lambda w: setattr(w, "spare", NodeFactory(site=w.local)),
    ),
    ("POST", "/api/nodes/{id}/token/"): Op("/api/nodes/{w.decode_node.pk}/token/", "admin", 201),
    ("POST", "/api/heartbeats/"): Op(
        "/api/heartbeats/",
        "node",
        200,
        body=lambda w: {"agent_version": "1", "clock": "2026-11-30T05:00:00Z"},
    ),
    ("GET", "/api/links/"): Op("/api/links/", "viewer", 200),
    ("POST", "/api/links/"): Op(
        "/api/links/",
        "admin",
        201,
        body=lambda w: {"from_site": w.local.pk, "to_site": w.remote.pk, "provisioned_mbit_s": 10},
    ),
    ("GET", "/api/links/{id}/"): Op("/api/links/{w.link.pk}/", "viewer", 200),
    ("PUT", "/api/links/{id}/"): Op(
        "/api/links/{w.link.pk}/", "admin", 200, body=put_back("/api/links/{w.link.pk}/")
    ),
    ("PATCH", "/api/links/{id}/"): Op(
        "/api/links/{w.link.pk}/", "admin", 200, body=lambda w: {"rtt_ms": 12.5}
    ),
    ("DELETE", "/api/links/{id}/"): Op("/api/links/{w.link.pk}/", "admin", 204),
    # catalog
    ("GET", "/api/models/"): Op("/api/models/", "viewer", 200),
    ("POST", "/api/models/"): Op(
        "/api/models/",
        "admin",
        201,
        body=lambda w: {"name": "m-new", "architecture": DENSE_ARCH, "parameter_count": 10},
    ),
    ("GET", "/api/models/kv-size/"): Op("/api/models/kv-size/?tokens=1024", "viewer", 200),
    ("GET", "/api/models/{id}/"): Op("/api/models/{w.model.pk}/", "viewer", 200),
    ("PUT", "/api/models/{id}/"): Op(
        "/api/models/{w.model.pk}/",
        "admin",
        200,
        # The factory's architecture lacks the defaults a write fills in: a real change.
        body=put_back("/api/models/{w.model.pk}/", unchanged=False),
    ),
    ("PATCH", "/api/models/{id}/"): Op(
        "/api/models/{w.model.pk}/", "admin", 200, body=lambda w: {"family": "renamed"}
    ),
    ("DELETE", "/api/models/{id}/"): Op(
        "/api/models/{w.spare.pk}/",
        "admin",
        204,
        before=lambda w: setattr(w, "spare", ModelSpecFactory()),
    ),
    ("GET", "/api/models/{id}/kv-size/"): Op(
        "/api/models/{w.model.pk}/kv-size/?tokens=1024", "viewer", 200
    ),
    # deployments
    ("GET", "/api/deployments/"): Op("/api/deployments/", "viewer", 200),
    ("POST", "/api/deployments/"): Op(
        "/api/deployments/", "operator", 201, body=lambda w: {"name": "d2", "model": w.model.pk}
    ),
    ("GET", "/api/deployments/{id}/"): Op("/api/deployments/{w.deployment.pk}/", "viewer", 200),
    ("PUT", "/api/deployments/{id}/"): Op(
        "/api/deployments/{w.deployment.pk}/",
        "operator",
        200,
        body=lambda w: {
            **put_back("/api/deployments/{w.deployment.pk}/", drop=("kill_switch",))(w),
            "retry": 5,
        },
    ),
    ("PATCH", "/api/deployments/{id}/"): Op(
        "/api/deployments/{w.deployment.pk}/",
        "operator",
        200,
        body=lambda w: {"remote_share_percent": 10},
    ),
    ("DELETE", "/api/deployments/{id}/"): Op(
        "/api/deployments/{w.spare.pk}/",
        "operator",
        204,
        before=lambda w: setattr(w, "spare", make_deployment()),
    ),
    ("GET", "/api/deployments/{id}/config/"): Op(
        "/api/deployments/{w.deployment.pk}/config/", "viewer", 200
    ),
    ("GET", "/api/deployments/{id}/engines/"): Op(
        "/api/deployments/{w.deployment.pk}/engines/", "viewer", 200
    ),
    ("GET", "/api/deployments/{id}/snapshots/"): Op(
        "/api/deployments/{w.deployment.pk}/snapshots/", "viewer", 200
    ),
    ("GET", "/api/deployments/{id}/rollout-plan/"): Op(
        "/api/deployments/{w.deployment.pk}/rollout-plan/", "viewer", 200
    ),
    ("POST", "/api/deployments/{id}/restore/"): Op(
        "/api/deployments/{w.deployment.pk}/restore/",
        "operator",
        200,
        body=lambda w: {"version": 1},
    ),
    ("POST", "/api/deployments/{id}/kill-switch/"): Op(
        "/api/deployments/{w.deployment.pk}/kill-switch/",
        "operator",
        200,
        body=lambda w: {"enabled": True},
    ),
    ("POST", "/api/deployments/{id}/retire/"): Op(
        "/api/deployments/{w.deployment.pk}/retire/", "operator", 200
    ),
    ("POST", "/api/deployments/{id}/deploy/"): Op(
        "/api/deployments/{w.deployment.pk}/deploy/", "operator", 202, body=lambda w: {}
    ),
    ("POST", "/api/deployments/{id}/canary/"): Op(
        "/api/deployments/{w.deployment.pk}/canary/", "operator", 202, body=lambda w: {}
    ),
    ("POST", "/api/deployments/{id}/canary/pause/"): Op(
        "/api/deployments/{w.deployment.pk}/canary/pause/",
        "operator",
        200,
        before=lambda w: w.admin.post(f"/api/deployments/{w.deployment.pk}/canary/", {}),
    ),
    ("POST", "/api/deployments/{id}/canary/resume/"): Op(
        "/api/deployments/{w.deployment.pk}/canary/resume/",
        "operator",
        200,
        before=lambda w: (
            w.admin.post(f"/api/deployments/{w.deployment.pk}/canary/", {}),
            w.admin.post(f"/api/deployments/{w.deployment.pk}/canary/pause/"),
        ),
    ),
    ("POST", "/api/deployments/{id}/canary/abort/"): Op(
        "/api/deployments/{w.deployment.pk}/canary/abort/",
        "operator",
        202,
        before=lambda w: w.admin.post(f"/api/deployments/{w.deployment.pk}/canary/", {}),
    ),
    ("GET", "/api/pools/"): Op("/api/pools/", "viewer", 200),
    ("POST", "/api/pools/"): Op(
        "/api/pools/",
        "operator",
        201,
        body=lambda w: {"deployment": w.deployment.pk, "role": "prefill", "site": w.spare.pk},
        before=lambda w: setattr(w, "spare", SiteFactory(role="prefill")),
    ),
    ("GET", "/api/pools/{id}/"): Op("/api/pools/{w.decode_pool.pk}/", "viewer", 200),
    ("PUT", "/api/pools/{id}/"): Op(
        "/api/pools/{w.prefill_pool.pk}/",
        "operator",
        200,
        body=lambda w: {
            **put_back("/api/pools/{w.prefill_pool.pk}/")(w),
            "engine_settings": {"tp": 4},
        },
    ),
    ("PATCH", "/api/pools/{id}/"): Op(
        "/api/pools/{w.prefill_pool.pk}/",
        "operator",
        200,
        body=lambda w: {"engine_settings": {"tp": 8}},
    ),
    ("DELETE", "/api/pools/{id}/"): Op("/api/pools/{w.prefill_pool.pk}/", "operator", 204),
    ("POST", "/api/pools/{id}/drain/"): Op(
        "/api/pools/{w.decode_pool.pk}/drain/",
        "operator",
        200,
        body=lambda w: {"drain": [w.decode_node.pk], "reason": "endpoint test"},
    ),
    # rollouts
    ("GET", "/api/rollout-plans/"): Op("/api/rollout-plans/", "viewer", 200),
    ("POST", "/api/rollout-plans/"): Op(
        "/api/rollout-plans/",
        "operator",
        201,
        body=lambda w: {"name": "fast", "steps": [{"share_percent": 50}, {"share_percent": 100}]},
    ),
    ("GET", "/api/rollout-plans/{id}/"): Op("/api/rollout-plans/{w.plan.pk}/", "viewer", 200),
    ("PUT", "/api/rollout-plans/{id}/"): Op(
        "/api/rollout-plans/{w.plan.pk}/",
        "operator",
        200,
        body=put_back("/api/rollout-plans/{w.plan.pk}/"),
    ),
    ("PATCH", "/api/rollout-plans/{id}/"): Op(
        "/api/rollout-plans/{w.plan.pk}/",
        "operator",
        200,
        body=lambda w: {"gate_success_rate_min": 0.98},
    ),
    ("DELETE", "/api/rollout-plans/{id}/"): Op("/api/rollout-plans/{w.plan.pk}/", "operator", 204),
    # runs and telemetry
    ("GET", "/api/runs/"): Op("/api/runs/", "viewer", 200),
    ("POST", "/api/runs/"): Op("/api/runs/", "operator", 201, body=lambda w: {"kind": "selfcheck"}),
    ("GET", "/api/runs/{id}/"): Op("/api/runs/{w.run.pk}/", "viewer", 200),
    ("POST", "/api/runs/{id}/cancel/"): Op("/api/runs/{w.run.pk}/cancel/", "operator", 202),
    ("POST", "/api/runs/{id}/retry/"): Op(
        "/api/runs/{w.run.pk}/retry/",
        "operator",
        202,
        body=lambda w: {"from_step": 0},
        before=failed_run,
    ),
    ("GET", "/api/telemetry/samples/"): Op("/api/telemetry/samples/", "viewer", 200),
    ("GET", "/api/telemetry/samples/{id}/"): Op(
        "/api/telemetry/samples/{w.sample.pk}/", "viewer", 200
    ),
    ("GET", "/api/telemetry/traces/"): Op("/api/telemetry/traces/", "viewer", 200),
    ("GET", "/api/telemetry/traces/{id}/"): Op(
        "/api/telemetry/traces/{w.trace.pk}/", "viewer", 200
    ),
    ("POST", "/api/telemetry/trace-batches/"): Op(
        "/api/telemetry/trace-batches/", "node", 201, body=lambda w: {"traces": [_trace_doc()]}
    ),
    # planner
    ("POST", "/api/planner/evaluate/"): Op(
        "/api/planner/evaluate/?sweeps=false", "viewer", 200, body=lambda w: small_case_study()
    ),
    ("POST", "/api/planner/kv-size/"): Op(
        "/api/planner/kv-size/",
        "viewer",
        200,
        body=lambda w: {
            "model": w.model.pk,
            "lengths": [4096],
            "concurrency": 1,
            "window_s": 1.0,
            "link_gbps": 10,
        },
    ),
    ("GET", "/api/planner/presets/"): Op("/api/planner/presets/", "viewer", 200),
    ("GET", "/api/planner/scenarios/"): Op("/api/planner/scenarios/", "viewer", 200),
    ("POST", "/api/planner/scenarios/"): Op(
        "/api/planner/scenarios/",
        "operator",
        201,
        body=lambda w: {"name": "another", "body": small_case_study()},
    ),
    ("GET", "/api/planner/scenarios/{id}/"): Op(
        "/api/planner/scenarios/{w.scenario.pk}/", "viewer", 200
    ),
    ("PUT", "/api/planner/scenarios/{id}/"): Op(
        "/api/planner/scenarios/{w.scenario.pk}/",
        "operator",
        200,
        body=put_back("/api/planner/scenarios/{w.scenario.pk}/"),
    ),
    ("PATCH", "/api/planner/scenarios/{id}/"): Op(
        "/api/planner/scenarios/{w.scenario.pk}/",
        "operator",
        200,
        body=lambda w: {"description": "edited"},
    ),
    ("DELETE", "/api/planner/scenarios/{id}/"): Op(
        "/api/planner/scenarios/{w.scenario.pk}/", "operator", 204
    ),
    ("POST", "/api/planner/scenarios/{id}/evaluate/"): Op(
        "/api/planner/scenarios/{w.scenario.pk}/evaluate/?sweeps=false", "viewer", 200
    ),
    # schedules
    ("GET", "/api/site-prices/"): Op("/api/site-prices/", "viewer", 200),
    ("POST", "/api/site-prices/"): Op(
        "/api/site-prices/",
        "operator",
        201,
        body=lambda w: {"site": w.spare.pk, "gpu_hour_prices": [3.0] * 24},
        before=lambda w: setattr(w, "spare", SiteFactory()),
    ),
    ("GET", "/api/site-prices/{id}/"): Op("/api/site-prices/{w.price.pk}/", "viewer", 200),
    ("PUT", "/api/site-prices/{id}/"): Op(
        "/api/site-prices/{w.price.pk}/",
        "operator",
        200,
        body=put_back("/api/site-prices/{w.price.pk}/"),
    ),
    ("PATCH", "/api/site-prices/{id}/"): Op(
        "/api/site-prices/{w.price.pk}/",
        "operator",
        200,
        body=lambda w: {"gpu_hour_prices": [1.5] * 24},
    ),
    ("DELETE", "/api/site-prices/{id}/"): Op("/api/site-prices/{w.price.pk}/", "operator", 204),
    ("GET", "/api/tidal-schedules/"): Op("/api/tidal-schedules/", "viewer", 200),
    ("POST", "/api/tidal-schedules/"): Op(
        "/api/tidal-schedules/",
        "operator",
        201,
        body=lambda w: {
            "deployment": w.spare.pk,
            "scenario": small_case_study(),
            "remote_site": w.remote.pk,
            "local_site": w.local.pk,
            "capacity": [1] * 24,
        },
        before=lambda w: setattr(w, "spare", make_deployment()),
    ),
    ("GET", "/api/tidal-schedules/{id}/"): Op(
        "/api/tidal-schedules/{w.schedule.pk}/", "viewer", 200
    ),
    ("PUT", "/api/tidal-schedules/{id}/"): Op(
        "/api/tidal-schedules/{w.schedule.pk}/",
        "operator",
        200,
        body=put_back("/api/tidal-schedules/{w.schedule.pk}/"),
    ),
    ("PATCH", "/api/tidal-schedules/{id}/"): Op(
        "/api/tidal-schedules/{w.schedule.pk}/",
        "operator",
        200,
        body=lambda w: {"ttft_limit_ms": 9000},
    ),
    ("DELETE", "/api/tidal-schedules/{id}/"): Op(
        "/api/tidal-schedules/{w.schedule.pk}/", "operator", 204
    ),
    ("GET", "/api/tidal-schedules/{id}/what-if/"): Op(
        "/api/tidal-schedules/{w.schedule.pk}/what-if/", "viewer", 200
    ),
    ("POST", "/api/tidal-schedules/{id}/what-if/"): Op(
        "/api/tidal-schedules/{w.schedule.pk}/what-if/", "viewer", 200, body=lambda w: {}
    ),
    ("GET", "/api/tidal-schedules/{id}/recorded-cost/"): Op(
        "/api/tidal-schedules/{w.schedule.pk}/recorded-cost/", "viewer", 200
    ),
    ("GET", "/api/tidal-applications/"): Op("/api/tidal-applications/", "viewer", 200),
    ("GET", "/api/tidal-applications/{id}/"): Op(
        "/api/tidal-applications/{w.application.pk}/", "viewer", 200
    ),
    ("GET", "/api/rebalance-proposals/"): Op("/api/rebalance-proposals/", "viewer", 200),
    ("GET", "/api/rebalance-proposals/{id}/"): Op(
        "/api/rebalance-proposals/{w.proposal.pk}/", "viewer", 200
    ),
    ("POST", "/api/rebalance-proposals/{id}/apply/"): Op(
        "/api/rebalance-proposals/{w.proposal.pk}/apply/", "operator", 200
    ),
    ("POST", "/api/rebalance-proposals/{id}/dismiss/"): Op(
        "/api/rebalance-proposals/{w.proposal.pk}/dismiss/", "operator", 200
    ),
    # alerts
    ("GET", "/api/alert-rules/"): Op("/api/alert-rules/", "viewer", 200),
    ("POST", "/api/alert-rules/"): Op(
        "/api/alert-rules/",
        "operator",
        201,
        body=lambda w: {
            "name": "kv-queue",
            "layer": "service",
            "level": "warning",
            "metric": "kv_link_queue_bytes",
            "subject_type": "inventory.node",
            "aggregate": "max",
            "comparison": "gt",
            "threshold": 1e9,
            "window_s": 120,
        },
    ),
    ("GET", "/api/alert-rules/{id}/"): Op("/api/alert-rules/{w.rule.pk}/", "viewer", 200),
    ("PUT", "/api/alert-rules/{id}/"): Op(
        "/api/alert-rules/{w.rule.pk}/",
        "operator",
        200,
        body=put_back("/api/alert-rules/{w.rule.pk}/"),
    ),
    ("PATCH", "/api/alert-rules/{id}/"): Op(
        "/api/alert-rules/{w.rule.pk}/", "operator", 200, body=lambda w: {"threshold": 2000}
    ),
    ("DELETE", "/api/alert-rules/{id}/"): Op(
        "/api/alert-rules/{w.added_rule.pk}/", "operator", 204
    ),
    ("GET", "/api/alerts/"): Op("/api/alerts/", "viewer", 200),
    ("GET", "/api/alerts/{id}/"): Op("/api/alerts/{w.alert.pk}/", "viewer", 200),
    ("POST", "/api/alerts/{id}/acknowledge/"): Op(
        "/api/alerts/{w.alert.pk}/acknowledge/", "operator", 200, body=lambda w: {"note": "on it"}
    ),
    ("GET", "/api/alert-channels/"): Op("/api/alert-channels/", "operator", 200),
    ("POST", "/api/alert-channels/"): Op(
        "/api/alert-channels/",
        "operator",
        201,
        body=lambda w: {"name": "h2", "kind": "webhook", "target": "https://hooks.example.com/y"},
    ),
    ("GET", "/api/alert-channels/{id}/"): Op(
        "/api/alert-channels/{w.channel.pk}/", "operator", 200
    ),
    ("PUT", "/api/alert-channels/{id}/"): Op(
        "/api/alert-channels/{w.channel.pk}/",
        "operator",
        200,
        body=put_back("/api/alert-channels/{w.channel.pk}/"),
    ),
    ("PATCH", "/api/alert-channels/{id}/"): Op(
        "/api/alert-channels/{w.channel.pk}/", "operator", 200, body=lambda w: {"enabled": False}
    ),
    ("DELETE", "/api/alert-channels/{id}/"): Op(
        "/api/alert-channels/{w.channel.pk}/", "operator", 204
    ),
    # drills
    ("GET", "/api/drills/"): Op("/api/drills/", "viewer", 200),
    ("POST", "/api/drills/"): Op(
        "/api/drills/",
        "operator",
        201,
        body=lambda w: {
            "name": "cut-2",
            "deployment": w.deployment.pk,
            "kind": "link_cut",
            "run_now": False,
        },
    ),
    ("GET", "/api/drills/{id}/"): Op("/api/drills/{w.drill.pk}/", "viewer", 200),
    ("PUT", "/api/drills/{id}/"): Op(
        "/api/drills/{w.drill.pk}/", "operator", 200, body=put_back("/api/drills/{w.drill.pk}/")
    ),
    ("PATCH", "/api/drills/{id}/"): Op(
        "/api/drills/{w.drill.pk}/", "operator", 200, body=lambda w: {"fault_s": 7}
    ),
    # A drill with reports cannot be deleted (409, tests/console/drills): this one's goes first.
    ("DELETE", "/api/drills/{id}/"): Op(
        "/api/drills/{w.drill.pk}/",
        "operator",
        204,
        before=lambda w: DrillReport.objects.filter(drill=w.drill).delete(),
    ),
    ("POST", "/api/drills/{id}/run/"): Op(
        "/api/drills/{w.drill.pk}/run/",
        "operator",
        202,
        before=lambda w: drills.drill_report_abort(run_id=w.report.run_id, error="test"),
    ),
    ("GET", "/api/drill-reports/"): Op("/api/drill-reports/", "viewer", 200),
    ("GET", "/api/drill-reports/{id}/"): Op("/api/drill-reports/{w.report.pk}/", "viewer", 200),
    # gateway keys
    ("GET", "/api/gateway-keys/"): Op("/api/gateway-keys/", "viewer", 200),
    ("POST", "/api/gateway-keys/"): Op(
        "/api/gateway-keys/",
        "admin",
        201,
        body=lambda w: {"deployment": w.deployment.pk, "name": "team-x"},
    ),
    ("GET", "/api/gateway-keys/{id}/"): Op(
        "/api/gateway-keys/{w.gateway_key.pk}/", "viewer", 200, before=_gateway_key
    ),
    ("POST", "/api/gateway-keys/{id}/revoke/"): Op(
        "/api/gateway-keys/{w.gateway_key.pk}/revoke/", "admin", 200, before=_gateway_key
    ),
    ("GET", "/api/deployments/{id}/gateway-access/"): Op(
        "/api/deployments/{w.deployment.pk}/gateway-access/", "viewer", 200
    ),
    ("PUT", "/api/deployments/{id}/gateway-access/"): Op(
        "/api/deployments/{w.deployment.pk}/gateway-access/",
        "admin",
        200,
        body=lambda w: {"require_client_keys": True},
    ),
}

METHODS = {"get", "post", "put", "patch", "delete"}


def _served_operations() -> set[tuple[str, str]]:
    """Every (method, path) under /api/: the OpenAPI schema's operations plus the routes the
    schema leaves out (the API root, the schema and its two viewers)."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    found = {
        (method.upper(), path)
        for path, item in schema["paths"].items()
        for method in item
        if method in METHODS
    }

    def walk(patterns: list[Any], prefix: str) -> list[tuple[str, Any]]:
        routes = []
        for p in patterns:
            if isinstance(p, URLResolver):
                routes += walk(p.url_patterns, prefix + str(p.pattern))
            elif isinstance(p, URLPattern):
                routes.append((prefix + str(p.pattern), p.callback))
        return routes

    for route, callback in walk(get_resolver().url_patterns, "/"):
        if not route.startswith("/api/") or "format" in route:
            continue
        path = re.sub(r"\(\?P<pk>[^)]*\)", "{id}", route).replace("^", "").replace("$", "")
        path = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", path)
        actions = getattr(callback, "actions", None)
        if actions is not None:
            methods = {m.upper() for m in actions if m in METHODS}
        elif path in {"/api/", "/api/schema/", "/api/docs/", "/api/redoc/"}:
            methods = {"GET"}
        else:
            methods = {m for m, p in found if p == path}
            assert methods, f"{path} serves no documented method"
        found |= {(m, path) for m in methods}
    return found


def test_the_table_lists_every_api_operation(db: Any) -> None:
    served = _served_operations()

    assert sorted(served - set(OPS)) == [], "operations with no row in OPS"
    assert sorted(set(OPS) - served) == [], "rows in OPS the API does not serve"


def _call(api: APIClient, method: str, path: str, body: Any) -> Any:
    return getattr(api, method.lower())(path, body, format="json")


def _clients(api_as: Any, make_user: Any) -> dict[str, APIClient]:
    from console.core.services_tokens import api_token_issue

    clients = {"anonymous": api_as(None)}
    norole = APIClient()
    norole.credentials(
        HTTP_AUTHORIZATION=f"Token {api_token_issue(actor=None, user=make_user(None))[1]}"
    )
    clients["norole"] = norole
    for role in RANK:
        clients[role] = api_as(role)
    return clients


# POSTs that compute an answer and store nothing.
COMPUTATIONS = {
    ("POST", "/api/planner/evaluate/"),
    ("POST", "/api/planner/kv-size/"),
    ("POST", "/api/planner/scenarios/{id}/evaluate/"),
    ("POST", "/api/tidal-schedules/{id}/what-if/"),
}


@pytest.mark.parametrize("key", sorted(OPS), ids=lambda k: f"{k[0]} {k[1]}")
def test_every_operation_by_role(w, api_as, make_user, client, key):
    method, _ = key
    op = OPS[key]
    clients = _clients(api_as, make_user)
    if op.before:
        op.before(w)
    body = op.body(w) if op.body else None
    path = op.path.format(w=w)

    if op.role == "node":
        token = node_token_issue(actor=None, node=w.decode_node)
        for name in ("anonymous", "norole", *RANK):
            assert _call(clients[name], method, path, body).status_code == 401, name
        node = APIClient()
        node.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        response = _call(node, method, path, body)
        assert response.status_code == op.status, response.content
        return
    if op.role == "public":
        response = _call(clients["anonymous"], method, path, body)
        assert response.status_code == op.status, response.content
        return

    assert _call(clients["anonymous"], method, path, body).status_code == 401
    if op.role == "any":
        allowed = ["norole", *RANK]
    else:
        below = ["norole", *(r for r in RANK if RANK[r] < RANK[op.role])]
        for name in below:
            response = _call(clients[name], method, path, body)
            assert response.status_code == 403, (name, response.content)
        allowed = [r for r in RANK if RANK[r] >= RANK[op.role]]
    # The needed role succeeds; a read is answered the same to every role above it.
    audited = AuditLog.objects.count()
    for name in allowed if method == "GET" else allowed[:1]:
        response = _call(clients[name], method, path, body)
        assert response.status_code == op.status, (name, response.content)
    # Every write is in the audit log; reads, computations and a PUT of the object exactly as
    # stored (nothing changed, so nothing written) are not.
    if getattr(op.body, "unchanged", False):
        assert AuditLog.objects.count() == audited
    elif method != "GET" and key not in COMPUTATIONS:
        assert AuditLog.objects.count() > audited


HOSTILE_BODIES = [
    [],
    "just a string",
    {"id": HUGE, "name": {"a": [1]}, "version": {"a": 1}},
    {"pk": None, "site": HUGE, "deployment": "abc", "model": -1, "nodes": "abc"},
    {"steps": [{"share_percent": HUGE}], "body": [], "scenario": "x", "architecture": 5},
    {"capacity": [HUGE] * 24, "gpu_hour_prices": ["x"] * 24, "from_step": HUGE},
    {"version": HUGE, "enabled": "maybe", "tokens": [HUGE], "lengths": [-1]},
]
# Deletes last: run earlier, they would leave the other writes only 404s to answer.
WRITES = sorted(
    (k for k, op in OPS.items() if k[0] != "GET" and op.role != "public"),
    key=lambda k: (k[0] == "DELETE", k),
)


def test_every_write_answers_hostile_bodies_with_a_4xx(w):
    """One world for every write (a fresh one per operation would cost a minute)."""
    node = APIClient()
    node.credentials(
        HTTP_AUTHORIZATION=f"Bearer {node_token_issue(actor=None, node=w.decode_node)}"
    )
    failures = []
    for key in WRITES:
        method, _ = key
        op = OPS[key]
        if op.before:
            op.before(w)
        api = node if op.role == "node" else w.admin
        for body in HOSTILE_BODIES:
            response = _call(api, method, op.path.format(w=w), body)
            # Actions that take no body may ignore it (2xx); what matters is that none is a 500
            # and that every refusal is a JSON answer.
            if response.status_code >= 500 or (
                response.status_code >= 400
                and not response["Content-Type"].startswith("application/json")
            ):
                failures.append((key, body, response.status_code))

    assert len(WRITES) > 60
    assert failures == []


def test_every_operation_on_an_unknown_id_is_a_404(w):
    wrong, checked = [], 0
    for (method, path), op in sorted(OPS.items()):
        if "{id}" not in path:
            continue
        unknown = re.sub(r"\{w\.[a-z_]+\.pk\}", "999999", op.path)
        api = APIClient()
        if op.role == "node":
            token = node_token_issue(actor=None, node=w.decode_node)
            api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        else:
            api = w.admin
        status = _call(api, method, unknown, {}).status_code
        checked += 1
        if status != 404:
            wrong.append((method, unknown, status))

    assert checked > 60
    assert wrong == []


HOSTILE_QUERIES = [
    "page=abc",
    "page=" + HUGE,
    "page_size=-1",
    "page_size=abc",
    "ordering=nosuchfield",
    "ordering=-" + HUGE,
    "search=%00%ff",
    "tokens=abc",
    "version=" + HUGE,
    "id=abc&site=abc&deployment=" + HUGE + "&state=x&created_after=yesterday",
]
READS = sorted(k for k, op in OPS.items() if k[0] == "GET" and op.role != "public")


def test_every_read_answers_hostile_query_strings_without_a_500(w):
    failures = []
    for key in READS:
        if OPS[key].before:
            OPS[key].before(w)  # the row it reads (each such hook makes a row of its own)
        path = OPS[key].path.format(w=w).split("?")[0]
        for query in HOSTILE_QUERIES:
            response = w.admin.get(f"{path}?{query}")
            if response.status_code >= 500 and not (
                OPS[key].upstream
                and response.status_code in {502, 503, 504}
                and response.json().get("detail")
            ):
                failures.append((key, query, response.status_code))

    assert len(READS) > 40
    assert failures == []


# GET operations without an id that answer one document, not a collection.
NOT_LISTS = {
    "/api/",
    "/api/me/",
    "/api/schema/",
    "/api/docs/",
    "/api/redoc/",
    "/api/models/kv-size/",
}


def test_every_list_is_paginated(w):
    lists = [
        p
        for m, p in OPS
        if m == "GET" and ("{" not in p or p.endswith("/snapshots/")) and p not in NOT_LISTS
    ]
    unpaginated = []
    for key in lists:
        body = w.admin.get(OPS[("GET", key)].path.format(w=w)).json()
        if not (isinstance(body, dict) and {"count", "next", "previous", "results"} <= set(body)):
            unpaginated.append(key)

    assert len(lists) > 20
    assert unpaginated == []


def test_a_page_size_of_one_pages_through_a_list(w):
    first = w.admin.get("/api/audit-log/?page_size=1").json()
    second = w.admin.get(first["next"]).json()

    assert first["count"] > 2
    assert len(first["results"]) == len(second["results"]) == 1
    assert first["results"][0]["id"] != second["results"][0]["id"]

"""Request traces in the console: a gateway's real trace shipper POSTs to the live console
with its node token, the gateway node's clock skew moves the trace onto the console's clock,
and the API and the trace page show its legs with where each process logged them (each on
its own node's clock)."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta
from typing import Any

import aiohttp
import pytest
from django.test import Client

from agents.gateway.trace import TraceRing, new_trace
from agents.gateway.traceship import TraceShipper
from console.inventory.services import node_token_issue
from console.telemetry.models import RequestTrace
from tests.console.factories import NodeFactory, SiteFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client_as(make_user: Any) -> Any:
    def make(role: str | None) -> Client:
        client = Client()
        client.force_login(make_user(role))
        return client

    return make


def _remote_trace(request_id: str) -> Any:
    """A remote request as the gateway records it: queued 1 ms, prefill 2-302 ms of which
    the KV's last 100 ms on the wire, decode 3-400 ms with its first byte at 310 ms."""
    t0 = time.monotonic()
    trace = new_trace(request_id, "completions", t0)
    trace.stream, trace.prompt_tokens = True, 4096
    trace.mark("admitted", t0 + 0.001)
    trace.site, trace.prefill_instance, trace.decode_instance = "remote", "pf-1", "dc-1"
    trace.transfer_id = "t" * 32
    trace.mark("prefill_sent", t0 + 0.002)
    trace.mark("decode_sent", t0 + 0.003)
    trace.mark("prefill_done", t0 + 0.302)
    trace.prefill_answer({"bytes": 539648, "bytes_wire": 401112, "send_seconds": 0.1})
    trace.mark("decode_first_byte", t0 + 0.310)
    trace.mark("first_byte", t0 + 0.311)
    trace.mark("done", t0 + 0.400)
    trace.path, trace.outcome, trace.status = "remote", "ok", 200
    return trace


@pytest.fixture
def sites() -> dict[str, Any]:
    local = SiteFactory(name="local", role="decode")
    remote = SiteFactory(name="remote", role="prefill")
    gateway = NodeFactory(site=local, hostname="gw-1", clock_skew_ms=250.0)
    gateway.reported_children = [{"name": "gateway-1", "kind": "gateway"}]
    gateway.save()
    prefill = NodeFactory(site=remote, hostname="pf-1", clock_skew_ms=-400.0)
    prefill.reported_children = [{"name": "prefill-engine-1", "kind": "prefill-engine"}]
    prefill.save()
    decode = NodeFactory(site=local, hostname="dc-1", clock_skew_ms=None)
    return {"gateway": gateway, "prefill": prefill, "decode": decode}


def _ship(url: str, token: str, ring: TraceRing) -> int:
    async def go() -> int:
        shipper = TraceShipper(ring=ring, console_url=url, token=token, interval_s=1.0)
        async with aiohttp.ClientSession() as session:
            return await shipper.ship_once(session)

    return asyncio.run(go())


def test_shipped_trace_lands_on_the_console_clock_with_each_legs_log(
    live_server: Any, sites: dict[str, Any], api_as: Any, client_as: Any
) -> None:
    ring = TraceRing(16, ship_queue=16, sample_rate=1.0)
    trace = _remote_trace("req-abc")
    ring.add(trace)
    token = node_token_issue(actor=None, node=sites["gateway"])

    assert _ship(live_server.url, token, ring) == 1

    row = RequestTrace.objects.get()
    sent = datetime.fromisoformat(trace.to_json()["started_at"])
    # The gateway's clock runs 250 ms ahead of the console's: its timestamp is moved back.
    assert row.started_at == sent - timedelta(milliseconds=250)
    assert (row.node, row.skew_ms, row.path, row.total_ms) == (
        sites["gateway"],
        250.0,
        "remote",
        400.0,
    )
    assert ring.queued == 0

    doc = api_as("viewer").get(f"/api/telemetry/traces/{row.pk}/").json()
    legs = {leg["leg"]: leg for leg in doc["timeline"]}
    assert list(legs) == ["queue", "prefill", "transfer", "decode", "first_token"]
    assert (legs["transfer"]["start_ms"], legs["transfer"]["end_ms"]) == (202.0, 302.0)
    prefill_logs = legs["prefill"]["logs"]
    # The prefill node's clock is 400 ms behind: its log has the leg 400 ms earlier.
    at = datetime.fromisoformat(legs["prefill"]["at"])
    assert at == row.started_at + timedelta(milliseconds=2)
    assert datetime.fromisoformat(prefill_logs["node_time"]) == at - timedelta(milliseconds=400)
    assert prefill_logs["children"] == ["prefill-engine-1"]
    assert "logs prefill-engine-1" in prefill_logs["command"]
    assert "grep -F 'req-abc'" in prefill_logs["command"]
    assert legs["decode"]["logs"]["hostname"] == "dc-1"
    assert legs["decode"]["logs"]["skew_ms"] is None
    listed = api_as("viewer").get("/api/telemetry/traces/?request_id=req-abc").json()
    assert [t["id"] for t in listed["results"]] == [row.pk]

    page = client_as("viewer").get("/traces/?request_id=req-abc", follow=True)
    html = page.content.decode()
    assert page.status_code == 200
    for leg in ("queue", "prefill", "transfer", "decode", "first_token"):
        assert f'data-leg="{leg}"' in html
    assert "539648 bytes raw, 401112 bytes on the wire" in html
    assert "prefill-engine-1" in html
    assert "clock corrected by its skew 250.0 ms" in html

    # Viewers get the shell command; operators a link to each log page on this request's lines.
    prefill_page = f"/nodes/{sites['prefill'].pk}/logs/prefill-engine-1/?q=req-abc"
    assert prefill_logs["log_pages"] == {"prefill-engine-1": prefill_page}
    assert prefill_page not in html
    html = client_as("operator").get(f"/traces/{row.pk}/").content.decode()
    assert f'href="{prefill_page}"' in html
    assert f'href="/nodes/{sites["gateway"].pk}/logs/gateway-1/?q=req-abc"' in html


def test_batches_are_bounded_and_need_a_node_token(sites: dict[str, Any], api_as: Any) -> None:
    token = node_token_issue(actor=None, node=sites["gateway"])
    node = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    doc = _remote_trace("req-x").to_json()

    too_many = node.post(
        "/api/telemetry/trace-batches/", {"traces": [doc] * 201}, content_type="application/json"
    )
    huge = node.post(
        "/api/telemetry/trace-batches/",
        {"traces": [{**doc, "padding": "x" * 20000}]},
        content_type="application/json",
    )
    viewer = api_as("viewer").post(
        "/api/telemetry/trace-batches/", {"traces": [doc]}, format="json"
    )

    assert too_many.status_code == 400
    assert "traces" in too_many.json()
    assert huge.status_code == 400
    assert viewer.status_code == 401
    assert RequestTrace.objects.count() == 0


@pytest.mark.django_db
def test_the_gateways_node_keeps_the_skew_its_trace_was_converted_with(world: Any) -> None:
    from datetime import UTC, datetime

    from console.telemetry.models import RequestTrace
    from console.telemetry.services import trace_record_batch
    from console.telemetry.traces import trace_timeline

    node = world.decode_node
    node.clock_skew_ms = 100.0
    node.save(update_fields=["clock_skew_ms"])
    sent = datetime(2026, 12, 2, 7, 0, tzinfo=UTC)
    leg = {"leg": "decode", "start_ms": 0.0, "end_ms": 5.0, "instance": node.hostname}
    doc = {"request_id": "r-1", "started_at": sent, "total_ms": 5.0, "legs": [leg]}
    trace_record_batch(node=node, traces=[doc])
    node.clock_skew_ms = -900.0  # a later heartbeat measured another skew
    node.save(update_fields=["clock_skew_ms"])

    timeline = trace_timeline(RequestTrace.objects.select_related("node").get())

    # One clock per node: the times on the gateway's node are the ones it logged.
    assert timeline["gateway"]["skew_ms"] == 100.0
    assert timeline["gateway"]["node_time"] == sent
    assert timeline["legs"][0]["where"]["node_time"] == sent


def test_the_gateways_metrics_count_traces_shipped_refused_and_dropped(
    live_server: Any, sites: dict[str, Any]
) -> None:
    """What ``/metrics`` says about shipping: a refused batch (a viewer's token is no node
    token) is a failure put back; the node token ships it; a full queue drops and counts."""
    from prometheus_client import CollectorRegistry, generate_latest

    from agents.gateway.trace import TraceCollector
    from tests.agents.gateway.procs import metric

    ring = TraceRing(16, ship_queue=2, sample_rate=1.0)
    registry = CollectorRegistry()
    registry.register(TraceCollector(ring))
    for i in range(3):
        ring.add(_remote_trace(f"req-{i}"))

    def page() -> str:
        return generate_latest(registry).decode()

    assert metric(page(), "pdbridge_gateway_traces_dropped_total") == 1
    assert metric(page(), "pdbridge_gateway_traces_queued") == 2
    assert _ship(live_server.url, "not-a-node-token", ring) == 0
    assert metric(page(), "pdbridge_gateway_trace_ship_failures_total") == 1
    assert metric(page(), "pdbridge_gateway_traces_queued") == 2
    token = node_token_issue(actor=None, node=sites["gateway"])
    assert _ship(live_server.url, token, ring) == 2
    assert metric(page(), "pdbridge_gateway_traces_shipped_total") == 2
    assert metric(page(), "pdbridge_gateway_traces_queued") == 0

"""Producer and consumer capacity from the engines' own counters (``orchestrator.capacityops``):
the window between two scrapes, an idle window's lifetime figure, a restart, and the samples
one collection writes for a deployment whose engines are real processes (the gateway tests'
engine double: a test double for a GPU engine, whose delays are its compute)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from console.deployments.config import build_config
from console.deployments.services import pool_create
from console.telemetry.models import MetricSample
from orchestrator.capacityops import ENGINE_SCRAPE, collect_capacity, engine_capacity, parse_engine
from tests.agents.gateway.procs import Proc, start_double
from tests.console.factories import NodeFactory, SiteFactory, make_deployment

PAGE = """# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_count{model_name="a"} 10
vllm:request_prefill_time_seconds_count{model_name="b"} 5
vllm:request_decode_time_seconds_count{model_name="a"} 12
# TYPE pdbridge:engine_busy_seconds counter
pdbridge:engine_busy_seconds_total{model_name="a",phase="prefill"} 2.5
pdbridge:engine_busy_seconds_total{model_name="b",phase="prefill"} 0.5
pdbridge:engine_busy_seconds_total{model_name="a",phase="decode"} 4
"""


def test_a_page_is_summed_over_models_and_the_window_is_what_capacity_divides():
    now = parse_engine(PAGE)
    assert now == {
        "done": {"prefill": 15.0, "decode": 12.0},
        "busy": {"prefill": 3.0, "decode": 4.0},
    }
    before = {"done": {"prefill": 5.0}, "busy": {"prefill": 2.0}}
    assert engine_capacity(before, now, "prefill") == pytest.approx(10.0)  # 10 in 1 s busy
    idle = {"done": {"prefill": 15.0}, "busy": {"prefill": 3.0}}
    assert engine_capacity(idle, now, "prefill") == pytest.approx(5.0)  # lifetime: 15 / 3
    restarted = {"done": {"prefill": 50.0}, "busy": {"prefill": 1.0}}
    assert engine_capacity(restarted, now, "prefill") == pytest.approx(5.0)
    assert engine_capacity(None, parse_engine(""), "decode") is None  # never worked


@pytest.fixture
def doubles(tmp_path: Path) -> Iterator[dict[str, Proc]]:
    kv = tmp_path / "kv"
    kv.mkdir()
    procs = {
        "remote": start_double("remote", kv, tmp_path, prefill_delay_s=0.05),
        "local": start_double("local", kv, tmp_path, prefill_delay_s=0.02),
        "decode": start_double("decode", kv, tmp_path, token_delay_s=0.01),
    }
    yield procs
    for proc in procs.values():
        proc.stop()


def _port(proc: Proc) -> int:
    return int(proc.url.rsplit(":", 1)[1])


def _pool(deployment, role, site, proc, hostname="127.0.0.1"):
    node = NodeFactory(site=site, hostname=hostname, agent_address=f"{hostname}:1")
    return pool_create(
        actor=None, deployment=deployment, role=role, site=site, nodes=[node],
        engine_settings={"port": _port(proc), "model": "tiny", "engine_host": "127.0.0.1"},
    )  # fmt: skip


@pytest.mark.django_db
def test_one_collection_records_each_pools_capacity_from_its_engines(doubles):
    import json
    import urllib.request

    local = SiteFactory(name="local", role="both")
    remote = SiteFactory(name="remote", role="prefill")
    deployment = make_deployment(name="cap")
    _pool(deployment, "decode", local, doubles["decode"])
    _pool(deployment, "prefill", remote, doubles["remote"], hostname="remote-pre")
    _pool(deployment, "prefill", local, doubles["local"], hostname="local-pre")
    # Work for each: prefill legs at the two prefill engines, decodes at the decode engine.
    for name, kv, n in (("remote", {"do_remote_decode": True, "transfer_id": "r"}, 4),
                        ("local", {"do_remote_decode": True, "transfer_id": "l"}, 4),
                        ("decode", None, 3)):  # fmt: skip
        for i in range(n):
            body = {"model": "tiny", "prompt": f"p {i}", "max_tokens": 2}
            if kv:
                body["kv_transfer_params"] = {**kv, "transfer_id": f"{kv['transfer_id']}{i}"}
            request = urllib.request.Request(  # noqa: S310 - loopback http
                doubles[name].url + "/v1/completions", json.dumps(body).encode(),
                {"content-type": "application/json"},
            )  # fmt: skip
            urllib.request.urlopen(request, timeout=30).read()  # noqa: S310 - loopback

    at = timezone.now()
    written = collect_capacity(deployment, build_config(deployment), at)

    rows = MetricSample.objects.filter(subject_id=str(deployment.pk), at=at)
    assert written == rows.count() == 4
    producer = {
        r.labels["site"]: (r.labels["path"], r.value)
        for r in rows.filter(name="prefill_requests_per_second")
    }
    assert producer["remote"] == ("remote", pytest.approx(1 / 0.05))
    assert producer["local"] == ("local", pytest.approx(1 / 0.02))
    decode = rows.get(name="decode_requests_per_second")
    assert decode.value == pytest.approx(1 / (0.01 * 2))
    scrape = rows.get(name=ENGINE_SCRAPE)
    assert scrape.value == 3
    assert scrape.labels["missing"] == {}

    # An engine that does not answer is named and left out of its side's sum.
    doubles["local"].stop()
    later = at + timedelta(seconds=30)
    collect_capacity(deployment, build_config(deployment), later)
    again = MetricSample.objects.filter(subject_id=str(deployment.pk), at=later)
    assert "prefill:local-pre" in again.get(name=ENGINE_SCRAPE).labels["missing"]
    assert {r.labels["site"] for r in again.filter(name="prefill_requests_per_second")} == {
        "remote"
    }

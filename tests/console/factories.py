"""factory_boy factories for console rows. Deployments are made through the service (so they
have their version-1 snapshot) by ``make_deployment``."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import factory

from console.catalog.models import ModelSpec
from console.inventory.models import Link, Node, Site
from console.planner.kvsize import architecture_hash

DENSE_ARCH = {
    "dtype_bytes": 2,
    "layers": [{"kind": "full", "count": 4, "kv_heads": 2, "head_dim": 64}],
}


class SiteFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Site

    name = factory.Sequence(lambda n: f"site-{n}")
    region = "eu-west"
    role = "both"


class NodeFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Node

    site = factory.SubFactory(SiteFactory)
    hostname = factory.Sequence(lambda n: f"node-{n}")
    agent_address = factory.Sequence(lambda n: f"10.0.0.{n % 250 + 1}:7070")
    accelerator_type = "H200"
    accelerator_count = 8
    accelerator_memory_gib = 141


class LinkFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Link

    from_site = factory.SubFactory(SiteFactory)
    to_site = factory.SubFactory(SiteFactory)
    provisioned_mbit_s = 100_000


class ModelSpecFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ModelSpec

    name = factory.Sequence(lambda n: f"model-{n}")
    family = "test"
    architecture = DENSE_ARCH
    architecture_hash = factory.LazyAttribute(lambda o: architecture_hash(o.architecture))
    parameter_count = 1_000_000
    weights_sha256 = "ab" * 32


_deployment_numbers = itertools.count(1)


def make_deployment(**fields: Any) -> Any:
    from console.deployments.services import deployment_create

    fields.setdefault("name", f"dep-{next(_deployment_numbers)}")
    if "model" not in fields:
        fields["model"] = ModelSpecFactory()
    return deployment_create(actor=None, **fields)


def small_case_study(thresholds: int = 50) -> dict[str, Any]:
    """The PrfaaS case study with a coarse threshold grid (fast to plan, same optimum shape)."""
    from console.planner.presets import preset_scenario

    body = copy.deepcopy(preset_scenario("prfaas-case-study"))
    body["grid"] = {"thresholds": thresholds, "spacing": "linear"}
    return body


def make_tidal_schedule(
    *,
    deployment: Any,
    remote_site: Any,
    local_site: Any,
    capacity: list[int],
    scenario: dict[str, Any] | None = None,
    remote_prices: list[float] | None = None,
    local_prices: list[float] | None = None,
) -> Any:
    """Prices for the remote site (and the local one, if given), an enabled UTC schedule of
    ``deployment`` and the deployment made active (the tidal beat skips others)."""
    from console.deployments.services import deployment_transition
    from console.schedules.services import price_table_create, tidal_schedule_create

    price_table_create(actor=None, site=remote_site, gpu_hour_prices=remote_prices or [2.0] * 24)
    if local_prices is not None:
        price_table_create(actor=None, site=local_site, gpu_hour_prices=local_prices)
    schedule = tidal_schedule_create(
        actor=None,
        deployment=deployment,
        enabled=True,
        timezone="UTC",
        ttft_limit_ms=10_000,
        scenario=scenario or small_case_study(),
        remote_site=remote_site,
        local_site=local_site,
        capacity=capacity,
    )
    for state in ("deploying", "active"):
        deployment.refresh_from_db()
        deployment_transition(actor=None, deployment=deployment, to_state=state)
    deployment.refresh_from_db()
    return schedule

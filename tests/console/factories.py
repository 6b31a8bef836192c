"""factory_boy factories for console rows. Deployments are made through the service (so they
have their version-1 snapshot) by ``make_deployment``."""

from __future__ import annotations

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

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from console.deployments.services import pool_create
from tests.console.factories import (
    LinkFactory,
    ModelSpecFactory,
    NodeFactory,
    SiteFactory,
    make_deployment,
)


@dataclass
class World:
    """A small two-site system: a decode site with one node, a prefill site with one node, the
    link between them, a model and a deployment using both as pools."""

    local: Any
    remote: Any
    decode_node: Any
    prefill_node: Any
    link: Any
    model: Any
    deployment: Any
    decode_pool: Any
    prefill_pool: Any


@pytest.fixture
def world(db: Any) -> World:
    local = SiteFactory(name="local", role="decode")
    remote = SiteFactory(name="remote", role="prefill")
    decode_node = NodeFactory(site=local, hostname="dec-1", agent_address="10.0.0.5:7070")
    prefill_node = NodeFactory(site=remote, hostname="pre-1", agent_address="10.1.0.5:7070")
    link = LinkFactory(from_site=remote, to_site=local, provisioned_mbit_s=100_000)
    model = ModelSpecFactory(name="qwen3next-tiny")
    deployment = make_deployment(name="demo", model=model)
    decode_pool = pool_create(
        actor=None, deployment=deployment, role="decode", site=local, nodes=[decode_node]
    )
    prefill_pool = pool_create(
        actor=None, deployment=deployment, role="prefill", site=remote, nodes=[prefill_node]
    )
    deployment.refresh_from_db()
    return World(
        local, remote, decode_node, prefill_node, link, model, deployment, decode_pool, prefill_pool
    )

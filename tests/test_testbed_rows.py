"""The testbed's console rows (``pdbridge.testbed_rows.register``): the deployment's config
snapshot tells the gateway the model's real context and its tokenizer's ratio, so the
gateway's oversized-prompt check and length estimates hold on the testbed (#19: a
200,000-token prompt reached the prefill engine, and text was estimated at 4 characters a
token on a byte-level tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.engines.reference import zoo
from agents.gateway.config import GatewaySettings, parse_snapshot
from agents.gateway.length import capped, context_error, needs_count
from pdbridge.testbed_models import MODELS
from pdbridge.testbed_rows import Layout, Ports, register

pytestmark = pytest.mark.django_db


def _snapshot(model: str, tmp_path: Path) -> dict:
    from console.deployments.config import render_snapshot
    from console.deployments.models import ConfigSnapshot
    from pdbridge.testbed import make_pki

    pki = make_pki(tmp_path / "pki")  # register reads the shared certificate's identity
    ports = Ports(18000, 18001, 18002, 18003, 18004, 18005, 18006, 18007)
    rows = register(MODELS[model], ports, pki, 200.0, Layout.loopback("localhost"), "a" * 64)
    # What the gateway reads: the deployment's current config document, as the API serves it.
    latest = ConfigSnapshot.objects.filter(deployment_id=rows.deployment_id).latest("version")
    return render_snapshot(latest)


def test_the_testbed_snapshot_carries_the_zoo_models_context_and_byte_tokenizer(tmp_path):
    config = parse_snapshot(_snapshot("qwen3-next", tmp_path))

    assert config.max_model_len == zoo.MAX_MODEL_LEN == 8192
    assert config.chars_per_token == 1.0
    assert GatewaySettings().chars_per_token == 4.0  # the gateway's default is not used


def test_with_it_the_gateway_counts_an_oversized_byte_prompt_before_any_leg(tmp_path):
    """20,000 characters are 20,000 tokens to the zoo's tokenizer: over the 8,192-token
    context, so the gateway asks for an exact count and refuses with the client's numbers
    (at 4 characters a token it would have guessed 5,000, sent it on, and let the engine
    refuse it after the link share was taken)."""
    config = parse_snapshot(_snapshot("qwen3-next", tmp_path))
    prompt_chars = 20_000

    estimate = int(prompt_chars / config.chars_per_token + 0.5)
    guessed = int(prompt_chars / GatewaySettings().chars_per_token + 0.5)
    refusal = context_error("completions", prompt_chars + 1, 16, config.max_model_len)

    assert needs_count(estimate, 16, 64, config.max_model_len, False) is True
    assert needs_count(guessed, 16, 64, config.max_model_len, False) is False
    assert capped(estimate, config.max_model_len) == 8192
    assert refusal is not None
    assert refusal.message == (
        "the prompt is 20001 tokens and max_tokens asks for 16 more: 20017 tokens, over this "
        "model's context of 8192 tokens"
    )

"""Planner reads: resolve a scenario body's catalog reference (``kv.model``) into the model's
architecture, so that the pure model never sees a database id. Called by the API serializers
and the scenario services; blocking (one query); raises ``PlannerInputError`` naming
``kv.model`` or ``kv``."""

from __future__ import annotations

from typing import Any

from console.catalog.models import ModelSpec
from console.planner.errors import PlannerInputError


def model_for_id(value: Any, field: str) -> ModelSpec:
    """The catalog model with id ``value``; ``PlannerInputError`` on ``field`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlannerInputError(field, "must be a model id (an integer)")
    model = ModelSpec.objects.filter(pk=value).first()
    if model is None:
        raise PlannerInputError(field, f"no model with id {value}")
    return model


def scenario_resolve(body: Any) -> tuple[Any, ModelSpec | None]:
    """``kv: {"model": 3}`` -> ``kv: {"architecture": <model 3's architecture>}`` and the
    model; any other body is returned unchanged with ``None``."""
    if not (isinstance(body, dict) and isinstance(body.get("kv"), dict)):
        return body, None
    kv = body["kv"]
    if "model" not in kv:
        return body, None
    if len(kv) != 1:
        raise PlannerInputError(
            "kv", "give exactly one of fixed_bytes + per_token_bytes, points, architecture, model"
        )
    model = model_for_id(kv["model"], "kv.model")
    return {**body, "kv": {"architecture": model.architecture}}, model

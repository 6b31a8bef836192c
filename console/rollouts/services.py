"""Rollout plan writes and the default plan. Called by the API (operators), the admin and
the canary workflow (which asks ``rollout_plan_for`` which plan applies). Blocking; invalid
steps raise ``ValidationError`` naming ``steps[i].field``."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from console.core.crud import Actor, audited_create, audited_delete, audited_update
from console.deployments.models import Deployment
from console.rollouts.models import DEFAULT_PLAN_NAME, RolloutPlan, default_steps

STEP_FIELDS = ("share_percent", "min_duration_s", "min_requests")
MAX_STEPS = 20


def validate_steps(steps: Any) -> list[dict[str, int]]:
    """Steps as a normalised list, or ``ValidationError`` on ``steps`` naming the item."""

    def fail(message: str) -> ValidationError:
        return ValidationError({"steps": [message]})

    if not isinstance(steps, list) or not steps:
        raise fail("Must be a non-empty list of steps.")
    if len(steps) > MAX_STEPS:
        raise fail(f"At most {MAX_STEPS} steps.")
    normalised = []
    previous = 0
    for index, step in enumerate(steps):
        where = f"steps[{index}]"
        if not isinstance(step, dict):
            raise fail(f"{where}: must be an object.")
        unknown = sorted(set(step) - set(STEP_FIELDS))
        if unknown:
            raise fail(f"{where}.{unknown[0]}: not a step field ({', '.join(STEP_FIELDS)}).")
        item = {}
        for name in STEP_FIELDS:
            value = step.get(name, 0 if name != "share_percent" else None)
            if isinstance(value, bool) or not isinstance(value, int):
                raise fail(f"{where}.{name}: must be an integer.")
            item[name] = value
        if not 1 <= item["share_percent"] <= 100:
            raise fail(f"{where}.share_percent: must be between 1 and 100.")
        if item["share_percent"] <= previous:
            raise fail(f"{where}.share_percent: shares must be strictly increasing.")
        for name in ("min_duration_s", "min_requests"):
            if item[name] < 0:
                raise fail(f"{where}.{name}: must be >= 0.")
        previous = item["share_percent"]
        normalised.append(item)
    if previous != 100:
        raise fail(f"steps[{len(steps) - 1}].share_percent: the last step must be 100.")
    return normalised


def _normalise(fields: dict[str, Any]) -> dict[str, Any]:
    if "steps" in fields:
        return {**fields, "steps": validate_steps(fields["steps"])}
    return fields


@transaction.atomic
def rollout_plan_create(*, actor: Actor, **fields: Any) -> RolloutPlan:
    """Create a plan (shared, or for one deployment)."""
    fields.setdefault("steps", default_steps())
    return audited_create(actor=actor, model=RolloutPlan, fields=_normalise(fields))


@transaction.atomic
def rollout_plan_update(*, actor: Actor, plan: RolloutPlan, **fields: Any) -> RolloutPlan:
    """Change a plan's steps, gates, name or deployment."""
    plan, _ = audited_update(actor=actor, instance=plan, fields=_normalise(fields))
    return plan


@transaction.atomic
def rollout_plan_delete(*, actor: Actor, plan: RolloutPlan) -> None:
    """Delete a plan; its deployment falls back to the default plan."""
    audited_delete(actor=actor, instance=plan)


@transaction.atomic
def rollout_plan_default() -> RolloutPlan:
    """The shared default plan (1 -> 10 -> 50 -> 100), created on first use."""
    plan, _ = RolloutPlan.objects.get_or_create(
        name=DEFAULT_PLAN_NAME, defaults={"steps": default_steps(), "deployment": None}
    )
    return plan


def rollout_plan_for(deployment: Deployment) -> RolloutPlan:
    """The plan that applies to ``deployment``: its own, else the default."""
    own = RolloutPlan.objects.filter(deployment=deployment).first()
    return own or rollout_plan_default()

"""Planner scenario writes. Called by the API and the admin; blocking, one transaction each,
audited. A body that the planner rejects raises ``ValidationError`` keyed ``body.<field>``
(``body.lengths.sigma``), which the API turns into a 400."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from console.core.crud import Actor, audited_create, audited_delete, audited_update
from console.planner.errors import PlannerInputError
from console.planner.inputs import parse_scenario
from console.planner.models import PlannerScenario
from console.planner.selectors import scenario_resolve


def scenario_body_check(body: Any) -> None:
    """Raise ``ValidationError`` keyed ``body.<field>`` unless ``body`` evaluates. Also used
    by the admin form, so that a bad body is a form error there rather than a 500."""
    try:
        resolved, _ = scenario_resolve(body)
        parse_scenario(resolved)
    except PlannerInputError as exc:
        raise ValidationError(
            {f"body.{exc.field}" if exc.field else "body": [exc.message]}
        ) from None


@transaction.atomic
def scenario_create(*, actor: Actor, **fields: Any) -> PlannerScenario:
    """Save a scenario (its body must evaluate)."""
    if "body" not in fields:
        raise ValidationError({"body": ["This field is required."]})
    scenario_body_check(fields["body"])
    user = actor if actor is not None and actor.is_authenticated else None
    return audited_create(actor=actor, model=PlannerScenario, fields={**fields, "created_by": user})


@transaction.atomic
def scenario_update(*, actor: Actor, scenario: PlannerScenario, **fields: Any) -> PlannerScenario:
    """Change a scenario's name, description or body."""
    if "body" in fields:
        scenario_body_check(fields["body"])
    scenario, _ = audited_update(actor=actor, instance=scenario, fields=fields)
    return scenario


@transaction.atomic
def scenario_delete(*, actor: Actor, scenario: PlannerScenario) -> None:
    """Delete a scenario."""
    audited_delete(actor=actor, instance=scenario)

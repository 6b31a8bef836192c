"""Model catalog writes. Called by the API and the admin; blocking, one transaction each.

The architecture is validated (and hashed) with ``console.planner.kvsize``: an invalid one
raises ``ValidationError`` on ``architecture`` with the JSON path in the message.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from console.catalog.models import ModelSpec
from console.core.crud import Actor, audited_create, audited_delete, audited_update
from console.planner.kvsize import ArchitectureError, architecture_hash, validate_architecture


def _with_architecture(fields: dict[str, Any]) -> dict[str, Any]:
    if "architecture" not in fields:
        return fields
    try:
        normalised = validate_architecture(fields["architecture"])
    except ArchitectureError as exc:
        raise ValidationError({"architecture": [f"{exc.field}: {exc.message}"]}) from None
    return {
        **fields,
        "architecture": normalised,
        "architecture_hash": architecture_hash(normalised),
    }


@transaction.atomic
def model_create(*, actor: Actor, **fields: Any) -> ModelSpec:
    """Add a model to the catalog."""
    if "architecture" not in fields:
        raise ValidationError({"architecture": ["This field is required."]})
    return audited_create(actor=actor, model=ModelSpec, fields=_with_architecture(fields))


@transaction.atomic
def model_update(*, actor: Actor, model: ModelSpec, **fields: Any) -> ModelSpec:
    """Change a model. Deployments serving it get a new config version when their config
    (weights sha256, architecture hash, engine settings) changes."""
    model, changed = audited_update(actor=actor, instance=model, fields=_with_architecture(fields))
    if changed:
        from console.deployments.services import deployments_refresh  # deployments -> catalog

        deployments_refresh(actor=actor, reason=f"model {model.name} changed", model_ids=[model.pk])
    return model


@transaction.atomic
def model_delete(*, actor: Actor, model: ModelSpec) -> None:
    """Remove a model no deployment uses (otherwise 409)."""
    audited_delete(actor=actor, instance=model)

"""Audit log writes, shared by every app's services."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.forms.models import model_to_dict

from console.core.choices import AuditAction
from console.core.middleware import current_request_id
from console.core.models import AuditLog


def model_snapshot(instance: models.Model, *, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON-safe dict of the instance's concrete fields, for the audit log's before/after."""
    data = model_to_dict(instance, exclude=list(exclude))
    for field in instance._meta.concrete_fields:
        # model_to_dict skips non-editable fields (timestamps, versions); keep them.
        if field.name not in data and field.name not in exclude:
            data[field.name] = field.value_from_object(instance)
    return json.loads(json.dumps(data, cls=DjangoJSONEncoder, default=str))


def audit_record(
    *,
    actor: AbstractBaseUser | AnonymousUser | None,
    action: AuditAction,
    instance: models.Model,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    verb: str = "",
    actor_label: str = "",
) -> AuditLog:
    """Record one write. Call inside the same transaction as the write itself."""
    user = actor if actor is not None and actor.is_authenticated else None
    label = actor_label or (user.get_username() if user is not None else "system")
    return AuditLog.objects.create(
        actor=user,
        actor_label=label,
        action=action,
        verb=verb,
        object_type=instance._meta.label_lower,
        object_id=str(instance.pk or ""),
        object_repr=str(instance)[:200],
        before=before,
        after=after,
        request_id=current_request_id(),
    )

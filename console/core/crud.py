"""Audited create / update / delete of one model row, shared by every app's services.

App services call these for plain CRUD and add their own rules around them (config
refreshes, guards). Each helper validates with ``full_clean`` (a Django ``ValidationError``
naming the field becomes a 400 through the API's exception handler), saves, and writes the
audit log in the caller's transaction. Blocking; callers wrap them in ``transaction.atomic``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import models

from console.core.choices import AuditAction
from console.core.services import audit_record, model_snapshot

M = TypeVar("M", bound=models.Model)
Actor = AbstractBaseUser | AnonymousUser | None


def audited_create(*, actor: Actor, model: type[M], fields: dict[str, Any]) -> M:
    """Create ``model`` from ``fields`` (many-to-many values are lists of objects or ids)."""
    plain, m2m = _split_m2m(model, fields)
    instance = model(**plain)
    instance.full_clean()
    instance.save()
    for name, values in m2m.items():
        getattr(instance, name).set(values)
    audit_record(
        actor=actor, action=AuditAction.CREATE, instance=instance, after=model_snapshot(instance)
    )
    return instance


def audited_update(*, actor: Actor, instance: M, fields: dict[str, Any]) -> tuple[M, bool]:
    """Apply ``fields`` to ``instance``; returns ``(instance, changed)``. Nothing is written
    (and nothing audited) when no value changes."""
    # ``auto_now`` stamps move on every save: compared, they made every update look like a
    # change (an audit entry and, for links and sites, new config snapshots for a no-op).
    stamps = tuple(
        f.name for f in type(instance)._meta.concrete_fields if getattr(f, "auto_now", False)
    )
    before = model_snapshot(instance)
    plain, m2m = _split_m2m(type(instance), fields)
    for name, value in plain.items():
        setattr(instance, name, value)
    instance.full_clean()
    m2m_same = all(
        _pks(getattr(instance, name).all()) == _pks(values) for name, values in m2m.items()
    )
    unchanged = {k: v for k, v in before.items() if k not in stamps}
    if m2m_same and model_snapshot(instance, exclude=stamps) == unchanged:
        return instance, False
    instance.save()
    for name, values in m2m.items():
        getattr(instance, name).set(values)
    after = model_snapshot(instance)
    audit_record(
        actor=actor, action=AuditAction.UPDATE, instance=instance, before=before, after=after
    )
    return instance, True


def audited_delete(*, actor: Actor, instance: models.Model) -> None:
    """Delete ``instance``; a ``ProtectedError`` (still referenced) surfaces as a 409."""
    before = model_snapshot(instance)
    pk = instance.pk
    audit_record(actor=actor, action=AuditAction.DELETE, instance=instance, before=before)
    instance.delete()
    instance.pk = pk  # keep the id for the caller's response / logs


def _pks(values: Any) -> list[Any]:
    return sorted(v.pk if isinstance(v, models.Model) else v for v in values)


def _split_m2m(model: type[models.Model], fields: dict[str, Any]) -> tuple[dict, dict]:
    m2m_names = {f.name for f in model._meta.many_to_many}
    plain = {k: v for k, v in fields.items() if k not in m2m_names}
    m2m = {k: v for k, v in fields.items() if k in m2m_names}
    return plain, m2m

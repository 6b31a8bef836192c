"""Page forms that write through the app's services, so a form and the API share one set of
rules and one audit trail.

A Django form here only turns posted text into typed values (a number field that is not a
number is the form's own message); every rule about the values stays in the service. What the
service refuses -- Django's ``ValidationError`` with a ``message_dict`` keyed by field
(``steps``, ``capacity[5]``, ``criteria``), ``Conflict`` (409) or another DRF
``APIException``, a unique value taken by a concurrent write (``IntegrityError``) -- becomes a
message on the form field it names (``capacity[5]`` goes to ``capacity``, prefixed with the
key), never a 500. Callers: the page views of drills, rollout plans and tidal schedules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from django import forms
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import IntegrityError
from rest_framework.exceptions import APIException

T = TypeVar("T")

#: ``steps[2].share_percent`` -> ``steps``, ``criteria.max_failed_requests`` -> ``criteria``.
_BASE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")
#: A message a service prefixed with the item it is about: ``steps[1].share_percent: ...``.
_ITEM_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z_][A-Za-z0-9_]*)+):\s")


def service_errors(exc: Exception) -> dict[str, list[str]]:
    """What a refused service call says, by the key it names (``__all__`` for the whole)."""
    if isinstance(exc, ValidationError):
        if hasattr(exc, "error_dict"):
            return {key: [str(m) for m in msgs] for key, msgs in exc.message_dict.items()}
        return {NON_FIELD_ERRORS: [str(m) for m in exc.messages]}
    if isinstance(exc, APIException):
        detail = exc.detail
        if isinstance(detail, Mapping):
            return {
                str(k): [str(m) for m in (v if isinstance(v, list) else [v])]
                for k, v in detail.items()
            }
        if isinstance(detail, list):
            return {NON_FIELD_ERRORS: [str(m) for m in detail]}
        return {NON_FIELD_ERRORS: [str(detail)]}
    return {NON_FIELD_ERRORS: ["Conflicts with an existing object (a unique value is taken)."]}


def item_key(message: str) -> str:
    """The item a message is about when the service prefixed it (``steps[1].share_percent``),
    else ``""``."""
    match = _ITEM_PREFIX.match(message)
    return match.group(1) if match else ""


def add_service_errors(
    form: forms.BaseForm,
    errors: dict[str, list[str]],
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Put each message on the form field its key names: the key itself, an alias (a
    ``criteria.max_failed_requests`` message on the form's ``criteria_max_failed_requests``),
    or the key's base field; anything else is a form-wide message. A message about one item
    of a field is prefixed with that item's key so the reader knows which one."""
    aliases = aliases or {}
    for key, messages in errors.items():
        for message in messages:
            item = item_key(message)
            target = (aliases.get(item) if item else None) or aliases.get(key) or _field(form, key)
            named = key in (NON_FIELD_ERRORS, target) or message.startswith(item or key)
            form.add_error(target, message if named else f"{key}: {message}")


def _field(form: forms.BaseForm, key: str) -> str | None:
    if key in form.fields:
        return key
    base = _BASE.match(key)
    return base.group(1) if base and base.group(1) in form.fields else None


def call_service(
    form: forms.BaseForm,
    service: Callable[..., T],
    aliases: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> T | None:
    """``service(**kwargs)``; on a refusal, the messages go onto ``form`` and None comes
    back (the service's transaction has rolled back: nothing was written or audited)."""
    try:
        return service(**kwargs)
    except (ValidationError, APIException, IntegrityError) as exc:
        add_service_errors(form, service_errors(exc), aliases)
        return None


def save_through(
    form: forms.BaseForm,
    *,
    actor: Any,
    create: Callable[..., T],
    update: Callable[..., T],
    instance: Any,
    instance_kwarg: str,
    aliases: Mapping[str, str] | None = None,
    **extra: Any,
) -> T | None:
    """A valid form's ``service_fields()`` through ``create`` (no ``instance``: with ``extra``)
    or ``update`` (``instance_kwarg=instance``); None when the form is invalid or the service
    refused (the refusals are on the form, see :func:`call_service`)."""
    if not form.is_valid():
        return None
    fields = form.service_fields()  # type: ignore[attr-defined]
    if instance is None:
        return call_service(form, create, aliases, actor=actor, **extra, **fields)
    return call_service(form, update, aliases, actor=actor, **{instance_kwarg: instance}, **fields)


def hourly_values(data: Mapping[str, Any], prefix: str, *, integer: bool) -> list[Any]:
    """The 24 inputs ``<prefix>_0`` .. ``<prefix>_23`` as numbers. A value that does not
    parse is passed on as the text typed, so the service's check names its hour
    (``capacity[5]: Must be an integer.``)."""
    out: list[Any] = []
    for hour in range(24):
        raw = str(data.get(f"{prefix}_{hour}", "")).strip()
        try:
            out.append(int(raw) if integer else float(raw))
        except ValueError:
            out.append(raw)
    return out


def hourly_blank(data: Mapping[str, Any], prefix: str) -> bool:
    """True when none of the 24 inputs of ``prefix`` holds anything (an optional table)."""
    return not any(str(data.get(f"{prefix}_{hour}", "")).strip() for hour in range(24))


def hourly_errors(form: forms.BaseForm, field: str) -> dict[int, str]:
    """Hour -> message, for the hours the form's messages on ``field`` name (``field[5]``),
    so the grid can mark the cell."""
    marked: dict[int, str] = {}
    for message in form.errors.get(field, []):
        match = re.match(rf"^{re.escape(field)}\[(\d+)\]", message)
        if match:
            marked[int(match.group(1))] = message
    return marked


def hour_cells(form: forms.BaseForm, field: str, current: list[Any] | None) -> list[dict[str, Any]]:
    """The 24 cells of an hourly grid: the input's name, what was posted (or ``current``),
    and the message naming that hour, if any (``field[5]: ...``)."""
    marked = hourly_errors(form, field) if form.is_bound else {}
    cells = []
    for hour in range(24):
        name = form.add_prefix(f"{field}_{hour}")
        if form.is_bound:
            value = form.data.get(name, "")
        else:
            value = current[hour] if current and hour < len(current) else ""
        cells.append({"hour": hour, "name": name, "value": value, "error": marked.get(hour, "")})
    return cells

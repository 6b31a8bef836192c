"""Template helpers of the console pages: state colours, human sizes, and evidence rendering
(dicts as key/value tables, lists of dicts as tables, so a verification result with
per-prompt rows reads as a table)."""

from __future__ import annotations

import json
from typing import Any

from django import template
from django.urls import NoReverseMatch, reverse
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

register = template.Library()

_GOOD = {"succeeded", "online", "active", "ok", "pass", "passed", "true", "applied"}
_BAD = {"failed", "lost", "rolled_back", "error", "fail", "false", "expired"}
_WARN = {
    "running",
    "degraded",
    "deploying",
    "pending",
    "warning",
    "unknown",
    "canceled",
    "applying",
    "proposed",
}
_MAX_DEPTH = 4
_MAX_ROWS = 200


@register.filter
def state_class(value: Any) -> str:
    """CSS class of a state badge: good / bad / warn / neutral."""
    text = str(value).lower()
    if text in _GOOD:
        return "good"
    if text in _BAD:
        return "bad"
    if text in _WARN:
        return "warn"
    return "neutral"


@register.filter
def human_bytes(value: Any) -> str:
    try:
        size = float(value)
    except (TypeError, ValueError):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


# Page of each object type the audit log can link to.
_OBJECT_PAGES = {
    "inventory.site": "site-page",
    "inventory.node": "node-page",
    "inventory.link": "link-page",
    "catalog.modelspec": "model-page",
    "deployments.deployment": "deployment-page",
    "runs.workflowrun": "run-page",
}


@register.simple_tag
def object_url(object_type: str, object_id: str) -> str:
    """The console page of an audited object, or "" when it has none (or the id is odd)."""
    name = _OBJECT_PAGES.get(object_type)
    if name is None or not str(object_id).isdigit():
        return ""
    try:
        return reverse(name, args=[int(object_id)])
    except NoReverseMatch:
        return ""


@register.filter
def sig(value: Any, digits: int = 4) -> Any:
    """A measured figure for a table: ``digits`` significant digits (0.0008311893924401346 ->
    0.0008312, 0.999000001 -> 0.999), whole numbers from 10**digits up; anything not a float
    unchanged (None stays None for ``default_if_none``)."""
    if not isinstance(value, float):
        return value
    if abs(value) >= 10**digits:
        return f"{value:.0f}"
    return f"{value:.{int(digits)}g}"


@register.filter
def thousands(value: Any) -> str:
    """1234567 -> 1,234,567 (no locale dependence)."""
    try:
        return f"{int(value):,}"
    except (TypeError, ValueError):
        return str(value)


@register.filter
def as_json(value: Any) -> str:
    """A config value as compact JSON (None -> null), for diffs."""
    return json.dumps(value, default=str, sort_keys=True)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        css = "good" if value else "bad"
        return format_html('<span class="badge {}">{}</span>', css, "yes" if value else "no")
    if value is None:
        return mark_safe('<span class="muted">-</span>')
    if isinstance(value, float):
        # Six significant digits, except for large values (epoch times, byte counts).
        return escape(f"{value:.6g}" if abs(value) < 1e6 else f"{value:.3f}")
    return escape(str(value))


def _render(value: Any, depth: int) -> str:
    if depth >= _MAX_DEPTH:
        return format_html("<code>{}</code>", json.dumps(value, default=str)[:500])
    if isinstance(value, dict):
        if not value:
            return mark_safe('<span class="muted">(empty)</span>')
        # _render's output is built only from escaped parts, so it is marked safe as a whole.
        rows = "".join(
            format_html("<tr><th>{}</th><td>{}</td></tr>", key, mark_safe(_render(item, depth + 1)))  # noqa: S308
            for key, item in list(value.items())[:_MAX_ROWS]
        )
        return f'<table class="kv">{rows}</table>'
    if isinstance(value, list):
        if value and all(isinstance(item, dict) for item in value):
            columns: list[str] = []
            for item in value[:_MAX_ROWS]:
                columns += [key for key in item if key not in columns]
            head = "".join(format_html("<th>{}</th>", c) for c in columns)
            body = "".join(
                "<tr{}>{}</tr>".format(
                    ' class="row-bad"' if item.get("match") is False else "",
                    "".join(f"<td>{_render(item.get(c), depth + 1)}</td>" for c in columns),
                )
                for item in value[:_MAX_ROWS]
            )
            more = (
                format_html('<p class="muted">{} more rows</p>', len(value) - _MAX_ROWS)
                if len(value) > _MAX_ROWS
                else ""
            )
            return f'<table class="grid"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}'
        return ", ".join(_render(item, depth + 1) for item in value[:_MAX_ROWS]) or format_html(
            '<span class="muted">(none)</span>'
        )
    return _scalar(value)


@register.filter
def evidence(value: Any) -> SafeString:
    """Render a step's evidence (any JSON) as HTML tables; every string is escaped."""
    return mark_safe(_render(value, 0))  # noqa: S308 - built only from escaped parts

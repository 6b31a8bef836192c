"""Overview panels: a feature that has something to show on the overview (alerts, canaries in
progress, the last drill) registers a panel from its ``AppConfig.ready()`` instead of editing
the overview. Each panel is a template fragment and a function that builds its context.

``overview_panels(request)`` is called by the overview view (blocking); a panel's context
function should make a bounded number of queries. Panels are shown in ``order``, after the
built-in sections, to users holding ``role``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest
from django.template.loader import render_to_string
from django.utils.safestring import SafeString, mark_safe

from console.core.choices import Role
from console.core.roles import user_has_role


@dataclass(frozen=True)
class OverviewPanel:
    """``template`` is rendered with ``context(request)`` plus the page's context processors."""

    key: str
    title: str
    template: str
    context: Callable[[HttpRequest], dict[str, Any]]
    role: Role = Role.VIEWER
    order: int = 100


_PANELS: dict[str, OverviewPanel] = {}


def overview_panel_register(panel: OverviewPanel) -> None:
    """Add (or replace, by key) an overview panel."""
    _PANELS[panel.key] = panel


def overview_panel_unregister(key: str) -> None:
    """Remove a panel (tests, apps that disable a feature)."""
    _PANELS.pop(key, None)


def overview_panels(request: HttpRequest) -> list[dict[str, Any]]:
    """The rendered panels the user may see: ``[{"key", "title", "html"}]``."""
    rendered = []
    for panel in sorted(_PANELS.values(), key=lambda p: (p.order, p.key)):
        if not user_has_role(request.user, panel.role):
            continue
        html: SafeString = mark_safe(  # noqa: S308 - a rendered (autoescaped) template
            render_to_string(panel.template, panel.context(request), request=request)
        )
        rendered.append({"key": panel.key, "title": panel.title, "html": html})
    return rendered

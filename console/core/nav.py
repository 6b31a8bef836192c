"""The console's navigation registry: every page section registers one entry here, so a
feature that arrives later (canary, drill reports, tidal, cost) adds itself with one
``nav_register`` call in its app's ``AppConfig.ready`` instead of editing the layout.

Called at import/ready time (not per request); ``nav_items`` is read by the ``roles``
context processor for every page. Entries whose URL name does not resolve are skipped, so a
half-installed app never breaks the layout."""

from __future__ import annotations

from dataclasses import dataclass

from django.urls import NoReverseMatch, reverse

from console.core.choices import ROLE_RANK, Role


@dataclass(frozen=True)
class NavItem:
    """One link of the top bar: ``label`` -> ``url_name``, shown to ``role`` and above,
    ordered by ``order`` (lower first)."""

    label: str
    url_name: str
    role: Role = Role.VIEWER
    order: int = 100


_REGISTRY: dict[str, NavItem] = {}


def nav_register(item: NavItem) -> None:
    """Add (or replace, by URL name) a navigation entry."""
    _REGISTRY[item.url_name] = item


def nav_items(role: Role | None) -> list[dict[str, str]]:
    """The entries a user of ``role`` may see, as ``{"label", "url", "url_name"}``."""
    if role is None:
        return []
    items = []
    for item in sorted(_REGISTRY.values(), key=lambda i: (i.order, i.label)):
        if ROLE_RANK[role] < ROLE_RANK[item.role]:
            continue
        try:
            url = reverse(item.url_name)
        except NoReverseMatch:
            continue
        items.append({"label": item.label, "url": url, "url_name": item.url_name})
    return items

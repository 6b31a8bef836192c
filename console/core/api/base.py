"""Base classes every app's API uses, so conventions live in one place."""

from __future__ import annotations

from rest_framework import viewsets


class ConsoleViewSetMixin:
    """Numeric ids only (``/api/sites/abc/`` is a 404, not a 500); every list filterable and
    orderable by id."""

    lookup_value_regex = r"[0-9]+"
    ordering_fields = ["id"]
    ordering = ["id"]


class ConsoleModelViewSet(ConsoleViewSetMixin, viewsets.ModelViewSet):
    """CRUD viewset. Subclasses route writes through their app's services in
    ``perform_create`` / ``perform_update`` / ``perform_destroy``."""


class ConsoleReadOnlyViewSet(ConsoleViewSetMixin, viewsets.ReadOnlyModelViewSet):
    pass

"""Base classes every app's API uses, so conventions live in one place."""

from __future__ import annotations

from typing import Any

from rest_framework import viewsets

from console.core.api.htmx import as_toast


class ConsoleViewSetMixin:
    """Numeric ids only (``/api/sites/abc/`` is a 404, not a 500); every list filterable and
    orderable by id."""

    lookup_value_regex = r"[0-9]+"
    ordering_fields = ["id"]
    ordering = ["id"]

    def finalize_response(self, request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        """An action a page button posted with htmx answers a toast (``console.core.api.htmx``);
        everything else, JSON."""
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
        if getattr(response, "data", None) is not None:
            toast = as_toast(request, response)
            if toast is not None:
                return toast
        return response


class ConsoleModelViewSet(ConsoleViewSetMixin, viewsets.ModelViewSet):
    """CRUD viewset. Subclasses route writes through their app's services in
    ``perform_create`` / ``perform_update`` / ``perform_destroy``."""


class ConsoleReadOnlyViewSet(ConsoleViewSetMixin, viewsets.ReadOnlyModelViewSet):
    pass


class ServiceModelViewSet(ConsoleModelViewSet):
    """CRUD whose writes go through the app's service functions, so that validation, the
    audit log and side effects live in one place. Subclasses set ``create_service``,
    ``update_service``, ``delete_service`` (wrapped in ``staticmethod``) and
    ``instance_kwarg`` (the keyword the update/delete services take the object as)."""

    instance_kwarg: str
    create_service: Any
    update_service: Any
    delete_service: Any

    def service_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments for update/delete services (``expected_version`` ...)."""
        return {}

    def perform_create(self, serializer: Any) -> None:
        serializer.instance = self.create_service(
            actor=self.request.user, **serializer.validated_data
        )

    def perform_update(self, serializer: Any) -> None:
        serializer.instance = self.update_service(
            actor=self.request.user,
            **{self.instance_kwarg: serializer.instance},
            **self.service_kwargs(),
            **serializer.validated_data,
        )

    def perform_destroy(self, instance: Any) -> None:
        self.delete_service(
            actor=self.request.user, **{self.instance_kwarg: instance}, **self.service_kwargs()
        )

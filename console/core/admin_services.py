"""Admin classes whose saves and deletes go through the app's service functions, so that an
edit in the Django admin is validated, audited and propagated exactly like one through the
API. ``ReadOnlyAdmin`` is for records only services may write (snapshots, credentials)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.http import HttpResponseRedirect
from rest_framework.exceptions import APIException


class ServiceModelAdmin(admin.ModelAdmin):
    """Subclasses set ``create_service`` / ``update_service`` / ``delete_service`` (as
    ``staticmethod``) and ``instance_kwarg``."""

    instance_kwarg: str
    create_service: Any
    update_service: Any
    delete_service: Any

    def save_model(self, request: Any, obj: Any, form: Any, change: bool) -> None:
        if change:
            fields = {n: form.cleaned_data[n] for n in form.changed_data if n in form.cleaned_data}
            original = type(obj).objects.get(pk=obj.pk)
            saved = self.update_service(
                actor=request.user, **{self.instance_kwarg: original}, **fields
            )
        else:
            saved = self.create_service(actor=request.user, **form.cleaned_data)
        obj.pk = saved.pk
        obj._state.adding = False

    def save_related(self, request: Any, form: Any, formsets: Any, change: bool) -> None:
        """Relations were saved by the service."""

    def delete_model(self, request: Any, obj: Any) -> None:
        self.delete_service(actor=request.user, **{self.instance_kwarg: obj})

    def delete_view(self, request: Any, object_id: str, extra_context: Any = None) -> Any:
        """A delete its service refuses (409: the object is in use) is shown as the
        service's reason on the object's page; nothing is deleted (the view's transaction
        rolls back)."""
        try:
            return super().delete_view(request, object_id, extra_context)
        except APIException as exc:
            self.message_user(request, _detail(exc), messages.ERROR)
            return HttpResponseRedirect(request.path.rsplit("/delete/", 1)[0] + "/change/")

    def delete_queryset(self, request: Any, queryset: Any) -> None:
        for obj in queryset:
            self.delete_model(request, obj)

    def response_action(self, request: Any, queryset: Any) -> Any:
        try:
            return super().response_action(request, queryset)
        except APIException as exc:
            self.message_user(request, _detail(exc), messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())


def _detail(exc: APIException) -> str:
    detail = exc.detail
    if isinstance(detail, dict):
        return "; ".join(f"{k}: {v}" for k, v in detail.items())
    return str(detail)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Browse only: these rows are written by services (versions, hashes, history)."""

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False

"""The gateway keys page: every deployment's client keys and key policy; admins create a key
(the page that answers the create shows the key, the only time), revoke one, and turn the
requirement on or off. Writes go through the services (audited)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse

from console.core.choices import Role
from console.core.pages import action_view, is_id, page_view, paginate
from console.core.roles import user_has_role
from console.deployments.models import Deployment
from console.gatewaykeys import services
from console.gatewaykeys.models import GatewayAccess, GatewayKey


def _page(request: HttpRequest, extra: dict[str, Any] | None = None) -> HttpResponse:
    keys = GatewayKey.objects.select_related("deployment", "created_by").order_by(
        "revoked_at", "deployment_id", "name"
    )
    required = set(
        GatewayAccess.objects.filter(require_client_keys=True).values_list(
            "deployment_id", flat=True
        )
    )
    deployments = [
        {"deployment": d, "required": d.pk in required} for d in Deployment.objects.order_by("name")
    ]
    context = {
        "page": paginate(request, keys),
        "deployments": deployments,
        "can_admin_keys": user_has_role(request.user, Role.ADMIN),
        **(extra or {}),
    }
    return render(request, "gatewaykeys/key_list.html", context)


@page_view
def key_list(request: HttpRequest) -> HttpResponse:
    return _page(request)


@action_view(Role.ADMIN)
def key_create(request: HttpRequest) -> HttpResponse:
    """Create a key and show it on the page that answers (never again)."""
    raw = request.POST.get("deployment", "")
    deployment = Deployment.objects.filter(pk=int(raw)).first() if is_id(raw) else None
    if deployment is None:
        return _page(request, {"error": "deployment: choose a deployment."})
    try:
        row, key = services.gateway_key_create(
            actor=request.user, deployment=deployment, name=request.POST.get("name", "")
        )
    except ValidationError as error:
        detail = "; ".join(f"{f}: {' '.join(m)}" for f, m in error.message_dict.items())
        return _page(request, {"error": detail})
    return _page(request, {"created": row, "created_key": key})


@action_view(Role.ADMIN)
def key_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    key = get_object_or_404(GatewayKey, pk=pk)
    try:
        services.gateway_key_revoke(actor=request.user, key=key)
        messages.success(request, f"Key {key.name} revoked.")
    except ValidationError as error:
        messages.error(request, "; ".join(error.messages))
    return HttpResponseRedirect(reverse("gateway-keys-page"))


@action_view(Role.ADMIN)
def access_update(request: HttpRequest, pk: int) -> HttpResponse:
    deployment = get_object_or_404(Deployment, pk=pk)
    required = request.POST.get("require_client_keys") == "true"
    services.gateway_access_update(
        actor=request.user, deployment=deployment, require_client_keys=required
    )
    state = "required" if required else "optional"
    messages.success(request, f"Client keys are {state} for {deployment.name}.")
    return HttpResponseRedirect(reverse("gateway-keys-page"))

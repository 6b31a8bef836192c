"""Deployment pages: the list, and one deployment with its pools, readiness checklist, current
config and history (diff, one-click restore), kill switch, workflow buttons and live charts.
Writes go through ``console.deployments.services``; a refused write is shown as a message."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import Prefetch
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.views.decorators.http import require_GET
from rest_framework.exceptions import APIException

from console.core.charts import time_chart
from console.core.choices import Role
from console.core.pages import action_view, is_id, page_view, paginate
from console.deployments import selectors, services
from console.deployments.config import render_snapshot
from console.deployments.models import Deployment, Pool
from console.deployments.readiness import readiness
from console.inventory.models import Link, Node
from console.runs.models import WorkflowRun
from console.telemetry import names
from console.telemetry.charts import ChartSpec, history_charts
from console.telemetry.selectors import series_by_label

CHART_WINDOW = timedelta(hours=6)
PATHS = ("remote", "local", "fallback")
# Workflow buttons, shown only when the API action exists (they arrive with their features).
WORKFLOW_ACTIONS = [
    ("Deploy", "deployment-deploy", "Run the eight-step deployment workflow."),
    ("Start canary", "deployment-canary", "Shift eligible traffic remote step by step with gates."),
    (
        "Run drill",
        "deployment-drill",
        "Cut the link or restart remote prefill and measure fallback.",
    ),
]


def _workflow_buttons(pk: int) -> list[dict[str, str]]:
    buttons = []
    for label, url_name, help_text in WORKFLOW_ACTIONS:
        try:
            url = reverse(url_name, args=[pk])
        except NoReverseMatch:
            continue
        buttons.append({"label": label, "url": url, "help": help_text})
    return buttons


@page_view
@require_GET
def deployment_list(request: HttpRequest) -> HttpResponse:
    """Every deployment with its pools, routing settings and kill switch, paginated."""
    deployments = Deployment.objects.select_related("model").prefetch_related(
        Prefetch("pools", queryset=Pool.objects.select_related("site"))
    )
    return render(
        request, "deployments/deployment_list.html", {"page": paginate(request, deployments)}
    )


def _charts(deployment: Deployment, pools: list[Pool]) -> list[str]:
    since = timezone.now() - CHART_WINDOW
    data = series_by_label(
        subject=deployment,
        names=[
            names.TTFT_P50,
            names.TTFT_P99,
            names.TPOT,
            names.SUCCESS,
            names.EFFECTIVE_THRESHOLD,
        ],
        label="path",
        since=since,
    )
    hint = "The gateway's metrics for this deployment are recorded here as it serves traffic."

    def by_path(name: str, suffix: str = "") -> dict[str, Any]:
        return {f"{p}{suffix}": data.get((name, p), []) for p in PATHS}

    ttft = {**by_path(names.TTFT_P50, " p50"), **by_path(names.TTFT_P99, " p99")}
    charts = [
        time_chart(title="TTFT p50 / p99 by path", lines=ttft, y_title="seconds", hint=hint),
        time_chart(title="TPOT by path", lines=by_path(names.TPOT), y_title="seconds", hint=hint),
        time_chart(
            title="Success rate",
            lines={"success": data.get((names.SUCCESS, ""), [])},
            y_title="share",
            hint=hint,
            from_zero=True,
        ),
        time_chart(
            title="Effective threshold",
            lines={"threshold": data.get((names.EFFECTIVE_THRESHOLD, ""), [])},
            y_title="tokens",
            hint=hint,
            step=True,
            limits={"configured": float(deployment.remote_prefill_threshold_tokens)},
        ),
    ]
    decode = [p.site_id for p in pools if p.role == "decode"]
    prefill = [p.site_id for p in pools if p.role == "prefill"]
    links = Link.objects.select_related("from_site").filter(
        from_site_id__in=prefill, to_site_id__in=decode
    )
    for link in links:
        charts += history_charts(
            subject=link,
            since=since,
            hint="The kv-link's byte counters are recorded here as KV moves.",
            specs=[
                ChartSpec(
                    f"Link {link.from_site.name} utilisation against its ceiling",
                    {"utilisation": names.LINK_UTILIZATION},
                    "share of link",
                    limits={"ceiling": deployment.link_utilization_ceiling},
                    from_zero=True,
                )
            ],
        )
    return charts


@page_view
@require_GET
def deployment_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One deployment: routing, actions, readiness, pools, live charts, runs, config history."""
    deployment = get_object_or_404(Deployment.objects.select_related("model"), pk=pk)
    pools = list(
        deployment.pools.select_related("site").prefetch_related(
            Prefetch("nodes", queryset=Node.objects.order_by("hostname")), "drained_nodes"
        )
    )
    history = paginate(request, deployment.snapshots.order_by("-version"), per_page=10)
    current = deployment.snapshots.filter(version=deployment.version).first()
    runs = WorkflowRun.objects.filter(
        target_type="deployments.deployment", target_id=str(deployment.pk)
    )[:10]
    context = {
        "deployment": deployment,
        "pools": pools,
        "checklist": readiness(deployment, pools),
        "current_json": json.dumps(render_snapshot(current), indent=2) if current else "",
        "history": history,
        "runs": runs,
        "buttons": _workflow_buttons(deployment.pk),
        "charts": _charts(deployment, pools),
        "proposals": deployment.rebalance_proposals.order_by("-created_at", "-id")[:5],
        "canary": selectors.canary_notice(deployment),
    }
    return render(request, "deployments/deployment_detail.html", context)


def _refused(request: HttpRequest, exc: Exception) -> None:
    if isinstance(exc, APIException):
        messages.error(request, str(exc.detail))
    elif isinstance(exc, ValidationError):
        messages.error(request, "; ".join(exc.messages))
    else:
        messages.error(request, str(exc))


@action_view(Role.OPERATOR)
def deployment_kill_switch(request: HttpRequest, pk: int) -> HttpResponse:
    """Form POST ``enabled=on|off``: flip the kill switch (the page asks to confirm first)."""
    deployment = get_object_or_404(Deployment, pk=pk)
    raw = request.POST.get("enabled", "")
    if raw not in {"on", "off"}:
        messages.error(request, "enabled: expected on or off")
    else:
        services.deployment_set_kill_switch(
            actor=request.user, deployment=deployment, enabled=raw == "on"
        )
        messages.success(
            request,
            "Kill switch ON: every request is prefilled locally."
            if raw == "on"
            else "Kill switch off: remote prefill allowed again.",
        )
    return HttpResponseRedirect(reverse("deployment-page", args=[pk]))


@action_view(Role.OPERATOR)
def deployment_restore(request: HttpRequest, pk: int) -> HttpResponse:
    """Form POST ``version=N``: make version N current again (as a new version)."""
    deployment = get_object_or_404(Deployment, pk=pk)
    raw = request.POST.get("version", "")
    if not is_id(raw):
        messages.error(request, "version: expected a version number")
    else:
        before = deployment.remote_share_percent
        try:
            restored = services.deployment_restore(
                actor=request.user, deployment=deployment, version=int(raw)
            )
        except (APIException, ValidationError, ValueError) as exc:
            _refused(request, exc)
        else:
            messages.success(request, restore_message(restored, int(raw)))
            for warning in selectors.share_edit_warnings(
                restored, before=before, after=restored.remote_share_percent
            ):
                messages.warning(request, warning)
    return HttpResponseRedirect(reverse("deployment-page", args=[pk]))


def restore_message(restored: Deployment, version: int) -> str:
    """What a restore did, and what it deliberately left as it was: the operator must not
    believe traffic is back on the remote path while the kill switch still holds it local."""
    parts = [f"Restored v{version} as v{restored.version}."]
    snapshot = restored.snapshots.filter(version=version).first()
    then = any(
        section.get("kill_switch")
        for section in (snapshot.config.values() if snapshot else [])
        if isinstance(section, dict)
    )
    if restored.kill_switch and not then:
        parts.append(
            "The kill switch stayed ON (a restore never turns it off): every request is still "
            "served locally until someone turns it off."
        )
    parts.append(f"The deployment stays {restored.state} (its lifecycle is not configuration).")
    return " ".join(parts)

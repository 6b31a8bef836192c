"""Rollout plan pages: every plan (shared or per deployment) with its steps and gates, one
plan with the deployments it applies to, and the create / edit form for operators
(``RolloutPlanForm`` through ``rollout_plan_create`` / ``rollout_plan_update``, the API's
services: the same step checks and audit entry; a refusal is a message on the input it
names). Steps are rows the page adds (an htmx GET of one empty row) and removes in place."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods

from console.core.choices import Role
from console.core.forms import save_through
from console.core.pages import action_view, is_id, page_view, paginate
from console.core.roles import user_has_role
from console.deployments.models import Deployment
from console.rollouts import services
from console.rollouts.forms import RolloutPlanForm
from console.rollouts.models import DEFAULT_PLAN_NAME, RolloutPlan


@page_view
@require_GET
def plan_list(request: HttpRequest) -> HttpResponse:
    """Rollout plans; ``?deployment=<id>`` (the deployment page's link) goes to the plan that
    deployment's canary uses: its own, else the shared default."""
    raw = request.GET.get("deployment", "")
    deployment = None
    if is_id(raw):
        deployment = Deployment.objects.filter(pk=int(raw)).first()
        plan = (
            RolloutPlan.objects.filter(deployment_id=int(raw)).first()
            or RolloutPlan.objects.filter(name=DEFAULT_PLAN_NAME).first()
        )
        if plan is not None:
            return HttpResponseRedirect(reverse("rollout-plan-page", args=[plan.pk]))
    return render(
        request,
        "rollouts/plan_list.html",
        {
            "page": paginate(request, RolloutPlan.objects.select_related("deployment")),
            "deployment": deployment,
            "default_name": DEFAULT_PLAN_NAME,
        },
    )


@page_view
@require_GET
def plan_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One plan: steps, gates, and the deployments whose canary uses it."""
    plan = get_object_or_404(RolloutPlan.objects.select_related("deployment"), pk=pk)
    if plan.deployment_id is not None:
        users = [plan.deployment]
    elif plan.name == DEFAULT_PLAN_NAME:
        users = list(Deployment.objects.filter(rollout_plan__isnull=True).order_by("name"))
    else:
        users = []
    return render(
        request,
        "rollouts/plan_detail.html",
        {"plan": plan, "users": users, "default_name": DEFAULT_PLAN_NAME},
    )


def _operator_form(request: HttpRequest) -> None:
    """Viewers see no forms: the form page itself answers 403 as its POST does."""
    if not user_has_role(request.user, Role.OPERATOR):
        raise PermissionDenied(f"This needs the {Role.OPERATOR.value} role.")


@page_view
@require_http_methods(["GET", "POST"])
def plan_new(request: HttpRequest) -> HttpResponse:
    """The create form, with the guide's 1 -> 10 -> 50 -> 100 steps to start from
    (``?deployment=<id>`` preselects the deployment)."""
    if request.method == "POST":
        return _plan_save(request, None)
    _operator_form(request)
    raw = request.GET.get("deployment", "")
    form = RolloutPlanForm(initial={"deployment": int(raw)} if is_id(raw) else {})
    return render(request, "rollouts/plan_form.html", {"form": form, "plan": None})


@page_view
@require_http_methods(["GET", "POST"])
def plan_edit(request: HttpRequest, pk: int) -> HttpResponse:
    """The edit form of one plan."""
    if request.method == "POST":
        return _plan_save(request, pk)
    _operator_form(request)
    plan = get_object_or_404(RolloutPlan, pk=pk)
    return render(
        request, "rollouts/plan_form.html", {"form": RolloutPlanForm(plan=plan), "plan": plan}
    )


@page_view
@require_GET
def plan_step_row(request: HttpRequest) -> HttpResponse:
    """One empty step row (the form's "Add step" appends it with htmx)."""
    _operator_form(request)
    return render(request, "rollouts/_step_row.html", {"row": {"errors": {}}})


@action_view(Role.OPERATOR)
def _plan_save(request: HttpRequest, pk: int | None) -> HttpResponse:
    """Create or change a plan through the services; to the plan's page with a message, or
    the form again (400) with each refusal on its input."""
    plan = get_object_or_404(RolloutPlan, pk=pk) if pk is not None else None
    form = RolloutPlanForm(request.POST, plan=plan)
    saved = save_through(
        form, actor=request.user, create=services.rollout_plan_create,
        update=services.rollout_plan_update, instance=plan, instance_kwarg="plan",
    )  # fmt: skip
    if saved is None:
        if plan is not None:
            plan.refresh_from_db()
        return render(request, "rollouts/plan_form.html", {"form": form, "plan": plan}, status=400)
    verb = "created" if plan is None else "saved"
    messages.success(request, f"Rollout plan {saved.name} {verb}.")
    return HttpResponseRedirect(reverse("rollout-plan-page", args=[saved.pk]))

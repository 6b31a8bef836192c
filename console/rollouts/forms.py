"""The rollout plan form: name, deployment (or none, for a shared plan), the four gates, and
the steps as rows of inputs that the page adds and removes with htmx. The form only parses
text; ``console.rollouts.services`` judges the plan (shares 1-100, strictly increasing,
ending at 100) and a refusal such as ``steps[1].share_percent: ...`` lands on that row's
input."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from django import forms

from console.deployments.models import Deployment
from console.rollouts.models import RolloutPlan, default_steps
from console.rollouts.services import STEP_FIELDS

_STEP_MESSAGE = re.compile(r"^steps\[(\d+)\]\.(\w+):")


def _number(raw: str) -> Any:
    """An integer when the text is one, else the text itself (the service names the step)."""
    try:
        return int(raw)
    except ValueError:
        return raw or None


class RolloutPlanForm(forms.Form):
    """A rollout plan as posted by the create and edit pages (steps from the
    ``step_<field>`` inputs, one of each per row, in order)."""

    name = forms.CharField(max_length=100)
    deployment = forms.ModelChoiceField(
        queryset=Deployment.objects.order_by("name"),
        required=False,
        empty_label="none: a shared plan",
        help_text="A deployment without a plan of its own uses the plan named default.",
    )
    gate_ttft_p50_ratio = forms.FloatField(
        label="TTFT p50 ratio max", initial=1.2, help_text="Remote p50 over the local baseline."
    )
    gate_ttft_p99_ratio = forms.FloatField(label="TTFT p99 ratio max", initial=1.5)
    gate_success_rate_min = forms.FloatField(
        label="success rate min", initial=0.99, help_text="A fraction, 0 - 1."
    )
    gate_link_utilization_max = forms.FloatField(
        label="link utilisation max", initial=0.7, help_text="A fraction, 0 - 1."
    )
    #: Carries the messages about the steps (the rows are rendered from ``step_rows``).
    steps = forms.Field(required=False, widget=forms.HiddenInput)

    def __init__(self, *args: Any, plan: RolloutPlan | None = None, **kwargs: Any) -> None:
        if plan is not None and "initial" not in kwargs:
            kwargs["initial"] = {
                "name": plan.name,
                "deployment": plan.deployment_id,
                "gate_ttft_p50_ratio": plan.gate_ttft_p50_ratio,
                "gate_ttft_p99_ratio": plan.gate_ttft_p99_ratio,
                "gate_success_rate_min": plan.gate_success_rate_min,
                "gate_link_utilization_max": plan.gate_link_utilization_max,
            }
        super().__init__(*args, **kwargs)
        self.plan = plan
        self._raw_steps = self._posted_steps(self.data) if self.is_bound else None

    @staticmethod
    def _posted_steps(data: Mapping[str, Any]) -> list[dict[str, str]]:
        columns = {name: data.getlist(f"step_{name}") for name in STEP_FIELDS}  # type: ignore[attr-defined]
        count = max((len(v) for v in columns.values()), default=0)
        return [
            {
                name: (columns[name][i] if i < len(columns[name]) else "").strip()
                for name in STEP_FIELDS
            }
            for i in range(count)
        ]

    def steps_value(self) -> list[dict[str, Any]]:
        """The posted steps for the service; an empty duration or request count is 0."""
        out = []
        for row in self._raw_steps or []:
            if not any(row.values()):
                continue  # a row added and left empty
            step: dict[str, Any] = {"share_percent": _number(row["share_percent"])}
            for name in ("min_duration_s", "min_requests"):
                if row[name]:
                    step[name] = _number(row[name])
            out.append(step)
        return out

    def step_rows(self) -> list[dict[str, Any]]:
        """Rows to render: what was posted (with the messages naming a row's input), or the
        plan's steps, or the guide's 1 -> 10 -> 50 -> 100."""
        if self._raw_steps is not None:
            rows: list[dict[str, Any]] = [dict(r) for r in self._raw_steps if any(r.values())]
        else:
            steps = self.plan.steps if self.plan is not None else default_steps()
            rows = [{name: str(step.get(name, "")) for name in STEP_FIELDS} for step in steps]
        for row in rows:
            row["errors"] = {}
        for message in self.errors.get("steps", []) if self.is_bound else []:
            match = _STEP_MESSAGE.match(message)
            if match and int(match.group(1)) < len(rows):
                rows[int(match.group(1))]["errors"][match.group(2)] = message
        return rows

    def service_fields(self) -> dict[str, Any]:
        data = self.cleaned_data
        return {
            "name": data["name"],
            "deployment": data.get("deployment"),
            "steps": self.steps_value(),
            "gate_ttft_p50_ratio": data["gate_ttft_p50_ratio"],
            "gate_ttft_p99_ratio": data["gate_ttft_p99_ratio"],
            "gate_success_rate_min": data["gate_success_rate_min"],
            "gate_link_utilization_max": data["gate_link_utilization_max"],
        }

    def gate_fields(self) -> list[forms.BoundField]:
        return [
            self[n]
            for n in (
                "gate_ttft_p50_ratio",
                "gate_ttft_p99_ratio",
                "gate_success_rate_min",
                "gate_link_utilization_max",
            )
        ]

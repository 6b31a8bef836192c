from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError

from console.core.admin_services import ServiceModelAdmin
from console.rollouts import services
from console.rollouts.models import RolloutPlan


class RolloutPlanForm(forms.ModelForm):
    """Shows step errors on the form (the service would otherwise raise them)."""

    class Meta:
        model = RolloutPlan
        fields = [
            "name",
            "deployment",
            "steps",
            "gate_ttft_p50_ratio",
            "gate_ttft_p99_ratio",
            "gate_success_rate_min",
            "gate_link_utilization_max",
        ]

    def clean_steps(self) -> Any:
        try:
            return services.validate_steps(self.cleaned_data["steps"])
        except ValidationError as exc:
            raise forms.ValidationError(exc.message_dict["steps"]) from None


@admin.register(RolloutPlan)
class RolloutPlanAdmin(ServiceModelAdmin):
    form = RolloutPlanForm
    list_display = [
        "name",
        "deployment",
        "gate_ttft_p50_ratio",
        "gate_ttft_p99_ratio",
        "gate_success_rate_min",
    ]
    search_fields = ["name"]
    instance_kwarg = "plan"
    create_service = staticmethod(services.rollout_plan_create)
    update_service = staticmethod(services.rollout_plan_update)
    delete_service = staticmethod(services.rollout_plan_delete)

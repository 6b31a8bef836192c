from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError

from console.core.admin_services import ServiceModelAdmin
from console.planner import services
from console.planner.models import PlannerScenario


class PlannerScenarioForm(forms.ModelForm):
    """Checks the body with the planner before the service sees it (errors on the field)."""

    class Meta:
        model = PlannerScenario
        fields = ["name", "description", "body"]

    def clean_body(self) -> Any:
        body = self.cleaned_data["body"]
        try:
            services.scenario_body_check(body)
        except ValidationError as exc:
            raise forms.ValidationError(
                [f"{field}: {'; '.join(msgs)}" for field, msgs in exc.message_dict.items()]
            ) from None
        return body


@admin.register(PlannerScenario)
class PlannerScenarioAdmin(ServiceModelAdmin):
    form = PlannerScenarioForm
    list_display = ["name", "created_by", "updated_at"]
    search_fields = ["name", "description"]
    readonly_fields = ["created_by"]
    instance_kwarg = "scenario"
    create_service = staticmethod(services.scenario_create)
    update_service = staticmethod(services.scenario_update)
    delete_service = staticmethod(services.scenario_delete)

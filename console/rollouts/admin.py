from django.contrib import admin

from console.core.admin_services import ServiceModelAdmin
from console.rollouts import services
from console.rollouts.models import RolloutPlan


@admin.register(RolloutPlan)
class RolloutPlanAdmin(ServiceModelAdmin):
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

from __future__ import annotations

from console.core.api.base import ServiceModelViewSet
from console.core.choices import Role
from console.rollouts import services
from console.rollouts.api.serializers import RolloutPlanSerializer
from console.rollouts.filtersets import RolloutPlanFilterSet
from console.rollouts.models import RolloutPlan


class RolloutPlanViewSet(ServiceModelViewSet):
    """Rollout plans. Viewers read; operators write. Steps are validated by the service
    (shares strictly increasing, 1-100, ending at 100)."""

    queryset = RolloutPlan.objects.all()
    serializer_class = RolloutPlanSerializer
    filterset_class = RolloutPlanFilterSet
    search_fields = ["name"]
    ordering_fields = ["id", "name"]
    write_role = Role.OPERATOR
    instance_kwarg = "plan"
    create_service = staticmethod(services.rollout_plan_create)
    update_service = staticmethod(services.rollout_plan_update)
    delete_service = staticmethod(services.rollout_plan_delete)

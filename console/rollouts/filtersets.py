import django_filters

from console.rollouts.models import RolloutPlan


class RolloutPlanFilterSet(django_filters.FilterSet):
    shared = django_filters.BooleanFilter(field_name="deployment", lookup_expr="isnull")

    class Meta:
        model = RolloutPlan
        fields = ["name", "deployment"]

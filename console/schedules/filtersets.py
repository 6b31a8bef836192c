import django_filters

from console.schedules.models import RebalanceProposal, TidalApplication, TidalSchedule


class TidalScheduleFilterSet(django_filters.FilterSet):
    class Meta:
        model = TidalSchedule
        fields = ["deployment", "enabled"]


class TidalApplicationFilterSet(django_filters.FilterSet):
    since = django_filters.IsoDateTimeFilter(field_name="hour_start", lookup_expr="gte")

    class Meta:
        model = TidalApplication
        fields = ["schedule", "outcome", "hour"]


class RebalanceProposalFilterSet(django_filters.FilterSet):
    class Meta:
        model = RebalanceProposal
        fields = ["deployment", "state"]

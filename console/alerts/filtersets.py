import django_filters

from console.alerts.models import Alert, AlertRule


class AlertRuleFilterSet(django_filters.FilterSet):
    class Meta:
        model = AlertRule
        fields = ["layer", "level", "enabled", "metric"]


class AlertFilterSet(django_filters.FilterSet):
    since = django_filters.IsoDateTimeFilter(field_name="started_at", lookup_expr="gte")

    class Meta:
        model = Alert
        fields = ["rule", "state", "level", "layer", "subject_type", "subject_id"]

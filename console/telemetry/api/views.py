import django_filters

from console.core.api.base import ConsoleReadOnlyViewSet
from console.telemetry.api.serializers import MetricSampleSerializer
from console.telemetry.models import MetricSample


class MetricSampleFilter(django_filters.FilterSet):
    since = django_filters.IsoDateTimeFilter(field_name="at", lookup_expr="gte")
    until = django_filters.IsoDateTimeFilter(field_name="at", lookup_expr="lt")

    class Meta:
        model = MetricSample
        fields = ["subject_type", "subject_id", "name"]


class MetricSampleViewSet(ConsoleReadOnlyViewSet):
    """Telemetry samples (read-only; written by heartbeats, probes and scrapers)."""

    queryset = MetricSample.objects.all()
    serializer_class = MetricSampleSerializer
    filterset_class = MetricSampleFilter
    ordering_fields = ["id", "at"]
    ordering = ["-at", "-id"]

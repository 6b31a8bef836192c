import django_filters

from console.inventory.models import Link, Node, Site


class SiteFilterSet(django_filters.FilterSet):
    class Meta:
        model = Site
        fields = ["name", "region", "role"]


class NodeFilterSet(django_filters.FilterSet):
    site_name = django_filters.CharFilter(field_name="site__name")
    heartbeat_before = django_filters.IsoDateTimeFilter(
        field_name="last_heartbeat_at", lookup_expr="lt"
    )

    class Meta:
        model = Node
        fields = ["site", "hostname", "status", "accelerator_type"]


class LinkFilterSet(django_filters.FilterSet):
    class Meta:
        model = Link
        fields = ["from_site", "to_site"]

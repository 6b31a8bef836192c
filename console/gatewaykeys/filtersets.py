import django_filters

from console.gatewaykeys.models import GatewayKey


class GatewayKeyFilterSet(django_filters.FilterSet):
    """``?deployment=<id>``, ``?name=``, ``?active=true|false``."""

    active = django_filters.BooleanFilter(field_name="revoked_at", lookup_expr="isnull")

    class Meta:
        model = GatewayKey
        fields = ["deployment", "name", "active"]

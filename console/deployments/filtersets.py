import django_filters

from console.deployments.models import ConfigSnapshot, Deployment, Pool


class DeploymentFilterSet(django_filters.FilterSet):
    class Meta:
        model = Deployment
        fields = ["name", "state", "model", "kill_switch", "compression"]


class PoolFilterSet(django_filters.FilterSet):
    node = django_filters.NumberFilter(field_name="nodes", distinct=True)

    class Meta:
        model = Pool
        fields = ["deployment", "role", "site"]


class SnapshotFilterSet(django_filters.FilterSet):
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    version_min = django_filters.NumberFilter(field_name="version", lookup_expr="gte")

    class Meta:
        model = ConfigSnapshot
        fields = ["author_label"]

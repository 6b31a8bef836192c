import django_filters

from console.catalog.models import ModelSpec


class ModelSpecFilterSet(django_filters.FilterSet):
    class Meta:
        model = ModelSpec
        fields = ["name", "family", "architecture_hash", "weights_sha256"]

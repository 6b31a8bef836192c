from typing import Any

from django import forms
from django.contrib import admin

from console.catalog import services
from console.catalog.models import ModelSpec
from console.core.admin_services import ServiceModelAdmin
from console.planner.kvsize import ArchitectureError, validate_architecture


class ModelSpecForm(forms.ModelForm):
    """Shows architecture errors on the form (the service would otherwise raise them)."""

    class Meta:
        model = ModelSpec
        fields = [
            "name",
            "family",
            "architecture",
            "parameter_count",
            "weights_uri",
            "weights_sha256",
            "engine_settings",
            "notes",
        ]

    def clean_architecture(self) -> Any:
        value = self.cleaned_data["architecture"]
        try:
            validate_architecture(value)
        except ArchitectureError as exc:
            raise forms.ValidationError(str(exc)) from None
        return value


@admin.register(ModelSpec)
class ModelSpecAdmin(ServiceModelAdmin):
    form = ModelSpecForm
    list_display = ["name", "family", "parameter_count", "architecture_hash"]
    list_filter = ["family"]
    search_fields = ["name", "family", "weights_sha256"]
    readonly_fields = ["architecture_hash"]
    instance_kwarg = "model"
    create_service = staticmethod(services.model_create)
    update_service = staticmethod(services.model_update)
    delete_service = staticmethod(services.model_delete)

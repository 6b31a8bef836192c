from django.contrib import admin

from console.catalog import services
from console.catalog.models import ModelSpec
from console.core.admin_services import ServiceModelAdmin


@admin.register(ModelSpec)
class ModelSpecAdmin(ServiceModelAdmin):
    list_display = ["name", "family", "parameter_count", "architecture_hash"]
    list_filter = ["family"]
    search_fields = ["name", "family", "weights_sha256"]
    readonly_fields = ["architecture_hash"]
    instance_kwarg = "model"
    create_service = staticmethod(services.model_create)
    update_service = staticmethod(services.model_update)
    delete_service = staticmethod(services.model_delete)

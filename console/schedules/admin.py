from django.contrib import admin

from console.core.admin_services import ReadOnlyAdmin, ServiceModelAdmin
from console.schedules import services
from console.schedules.models import (
    RebalanceProposal,
    SitePriceTable,
    TidalApplication,
    TidalSchedule,
)


@admin.register(SitePriceTable)
class SitePriceTableAdmin(ServiceModelAdmin):
    list_display = ["site", "kw_per_gpu", "updated_at"]
    instance_kwarg = "table"
    create_service = staticmethod(services.price_table_create)
    update_service = staticmethod(services.price_table_update)
    delete_service = staticmethod(services.price_table_delete)


@admin.register(TidalSchedule)
class TidalScheduleAdmin(ServiceModelAdmin):
    list_display = [
        "deployment",
        "enabled",
        "timezone",
        "ttft_limit_ms",
        "remote_site",
        "local_site",
    ]
    list_filter = ["enabled"]
    instance_kwarg = "schedule"
    create_service = staticmethod(services.tidal_schedule_create)
    update_service = staticmethod(services.tidal_schedule_update)
    delete_service = staticmethod(services.tidal_schedule_delete)


@admin.register(TidalApplication)
class TidalApplicationAdmin(ReadOnlyAdmin):
    list_display = ["schedule", "hour_start", "hour", "outcome", "config_version", "checks"]
    list_filter = ["outcome"]


@admin.register(RebalanceProposal)
class RebalanceProposalAdmin(ReadOnlyAdmin):
    list_display = ["deployment", "state", "created_at", "decided_at", "decided_by_label"]
    list_filter = ["state"]

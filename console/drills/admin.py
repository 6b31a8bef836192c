from django.contrib import admin

from console.drills.models import Drill, DrillReport


@admin.register(Drill)
class DrillAdmin(admin.ModelAdmin):
    list_display = ["name", "deployment", "kind", "fault_s", "schedule"]
    list_filter = ["kind"]
    search_fields = ["name"]


@admin.register(DrillReport)
class DrillReportAdmin(admin.ModelAdmin):
    list_display = ["id", "drill", "kind", "state", "failed_requests", "created_at"]
    list_filter = ["kind", "state"]
    readonly_fields = [f.name for f in DrillReport._meta.get_fields() if f.concrete]

from django.contrib import admin

from console.runs.models import StepRun, WorkflowRun


class StepRunInline(admin.TabularInline):
    model = StepRun
    extra = 0
    fields = ["index", "name", "state", "attempt", "worker", "started_at", "finished_at", "error"]
    readonly_fields = fields
    can_delete = False


@admin.register(WorkflowRun)
class WorkflowRunAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "kind",
        "state",
        "target_type",
        "target_id",
        "created_by",
        "created_at",
        "finished_at",
    ]
    list_filter = ["kind", "state"]
    search_fields = ["target_id", "error"]
    inlines = [StepRunInline]
    readonly_fields = [
        "kind",
        "target_type",
        "target_id",
        "state",
        "params",
        "result",
        "error",
        "created_by",
        "created_at",
        "started_at",
        "finished_at",
    ]

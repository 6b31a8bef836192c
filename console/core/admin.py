from django.contrib import admin

from console.core.models import AuditLog


@admin.register(AuditLog)
class AuditLogAdmin(admin.ModelAdmin):
    list_display = [
        "created_at",
        "actor_label",
        "action",
        "verb",
        "object_type",
        "object_id",
        "object_repr",
    ]
    list_filter = ["action", "object_type"]
    search_fields = ["actor_label", "object_repr", "object_id", "request_id"]
    readonly_fields = [f.name for f in AuditLog._meta.fields]

    def has_add_permission(self, request):  # the log is written by services only
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

"""Deployments are browsed in the admin and edited through the API or the web console, where
every change gets its version, snapshot and optimistic-concurrency check."""

from django.contrib import admin

from console.core.admin_services import ReadOnlyAdmin
from console.deployments.models import ConfigSnapshot, Deployment, Pool


class PoolInline(admin.TabularInline):
    model = Pool
    fields = ["role", "site", "nodes", "engine_settings"]
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


@admin.register(Deployment)
class DeploymentAdmin(ReadOnlyAdmin):
    list_display = ["name", "model", "state", "version", "remote_share_percent", "kill_switch"]
    list_filter = ["state", "kill_switch", "compression"]
    search_fields = ["name"]
    inlines = [PoolInline]


@admin.register(Pool)
class PoolAdmin(ReadOnlyAdmin):
    list_display = ["__str__", "deployment", "role", "site"]
    list_filter = ["role", "site"]


@admin.register(ConfigSnapshot)
class ConfigSnapshotAdmin(ReadOnlyAdmin):
    list_display = ["deployment", "version", "author_label", "reason", "created_at"]
    list_filter = ["deployment"]
    search_fields = ["reason", "author_label"]

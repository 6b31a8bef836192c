from typing import Any

from django.contrib import admin

from console.alerts import services
from console.alerts.models import Alert, AlertRule, NotificationChannel
from console.core.admin_services import ReadOnlyAdmin, ServiceModelAdmin


@admin.register(AlertRule)
class AlertRuleAdmin(ServiceModelAdmin):
    list_display = [
        "name",
        "layer",
        "level",
        "metric",
        "comparison",
        "threshold",
        "window_s",
        "enabled",
    ]
    list_filter = ["layer", "level", "enabled"]
    search_fields = ["name", "metric"]
    instance_kwarg = "rule"
    create_service = staticmethod(services.alert_rule_create)
    update_service = staticmethod(services.alert_rule_update)
    delete_service = staticmethod(services.alert_rule_delete)

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        """Shipped rules are turned off, not deleted (the service answers 409); a bulk delete
        that includes one is refused whole (Django's 403)."""
        if obj is not None and services.rule_is_shipped(obj):
            return False
        return super().has_delete_permission(request, obj)


@admin.register(Alert)
class AlertAdmin(ReadOnlyAdmin):
    list_display = [
        "rule_name",
        "level",
        "subject_type",
        "subject_id",
        "state",
        "value",
        "started_at",
        "resolved_at",
    ]
    list_filter = ["state", "level", "layer"]


@admin.register(NotificationChannel)
class NotificationChannelAdmin(ServiceModelAdmin):
    list_display = ["name", "kind", "min_level", "enabled"]
    instance_kwarg = "channel"
    create_service = staticmethod(services.channel_create)
    update_service = staticmethod(services.channel_update)
    delete_service = staticmethod(services.channel_delete)

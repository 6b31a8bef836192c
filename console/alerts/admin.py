from typing import Any

from django.contrib import admin, messages

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
        """Shipped rules are turned off, not deleted (the service answers 409)."""
        if obj is not None and services.rule_is_shipped(obj):
            return False
        return super().has_delete_permission(request, obj)

    def delete_queryset(self, request: Any, queryset: Any) -> None:
        shipped = [rule.name for rule in queryset if services.rule_is_shipped(rule)]
        if shipped:
            self.message_user(
                request,
                f"Shipped rules kept (turn them off): {', '.join(shipped)}",
                messages.WARNING,
            )
        super().delete_queryset(request, queryset.exclude(name__in=shipped))


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

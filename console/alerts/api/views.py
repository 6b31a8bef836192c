"""Alerts API: rules (operators edit), alerts with their history (viewers read) and
notification channels (operators only: targets may carry webhook tokens)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from console.alerts import services
from console.alerts.api.serializers import (
    AcknowledgeSerializer,
    AlertRuleSerializer,
    AlertSerializer,
    NotificationChannelSerializer,
)
from console.alerts.filtersets import AlertFilterSet, AlertRuleFilterSet
from console.alerts.models import Alert, AlertRule, NotificationChannel
from console.core.api.base import ConsoleViewSetMixin, ServiceModelViewSet
from console.core.choices import Role


class AlertRuleViewSet(ServiceModelViewSet):
    """Alert rules (the shipped defaults are installed by migration)."""

    queryset = AlertRule.objects.all()
    serializer_class = AlertRuleSerializer
    filterset_class = AlertRuleFilterSet
    search_fields = ["name", "metric"]
    write_role = Role.OPERATOR
    instance_kwarg = "rule"
    create_service = staticmethod(services.alert_rule_create)
    update_service = staticmethod(services.alert_rule_update)
    delete_service = staticmethod(services.alert_rule_delete)


class AlertViewSet(ConsoleViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """Firing and resolved alerts, newest first (``?state=firing`` for what is open now)."""

    queryset = Alert.objects.all()
    serializer_class = AlertSerializer
    filterset_class = AlertFilterSet
    ordering_fields = ["id", "started_at", "level"]
    ordering = ["-started_at", "-id"]
    action_roles = {"acknowledge": Role.OPERATOR}

    @extend_schema(request=AcknowledgeSerializer, responses=AlertSerializer)
    @action(detail=True, methods=["post"])
    def acknowledge(self, request: Request, pk: str | None = None) -> Response:
        """Someone is on it: who, when and a note are recorded (audited); the alert keeps
        firing until its condition ends. 409 when it is resolved or already acknowledged."""
        body = AcknowledgeSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        alert = services.alert_acknowledge(
            actor=request.user, alert=self.get_object(), note=body.validated_data["note"]
        )
        return Response(AlertSerializer(alert).data)


class NotificationChannelViewSet(ServiceModelViewSet):
    """Webhook and e-mail channels."""

    queryset = NotificationChannel.objects.all()
    serializer_class = NotificationChannelSerializer
    filterset_fields = ["kind", "enabled"]
    read_role = Role.OPERATOR
    write_role = Role.OPERATOR
    instance_kwarg = "channel"
    create_service = staticmethod(services.channel_create)
    update_service = staticmethod(services.channel_update)
    delete_service = staticmethod(services.channel_delete)

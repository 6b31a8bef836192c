from django.contrib import admin

from console.telemetry.models import MetricSample, RequestTrace


@admin.register(MetricSample)
class MetricSampleAdmin(admin.ModelAdmin):
    list_display = ["at", "subject_type", "subject_id", "name", "value"]
    list_filter = ["subject_type", "name"]
    search_fields = ["subject_id", "name"]
    readonly_fields = ["subject_type", "subject_id", "name", "value", "labels", "at"]


@admin.register(RequestTrace)
class RequestTraceAdmin(admin.ModelAdmin):
    """Traces are written by gateways (``POST /api/telemetry/trace-batches/``) only."""

    list_display = ["started_at", "request_id", "node", "path", "outcome", "total_ms"]
    list_filter = ["path", "outcome"]
    search_fields = ["request_id"]
    readonly_fields = [
        "request_id", "node", "started_at", "path", "outcome", "total_ms", "skew_ms",
        "document", "received_at",
    ]  # fmt: skip

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False

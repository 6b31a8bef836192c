from django.contrib import admin

from console.telemetry.models import MetricSample


@admin.register(MetricSample)
class MetricSampleAdmin(admin.ModelAdmin):
    list_display = ["at", "subject_type", "subject_id", "name", "value"]
    list_filter = ["subject_type", "name"]
    search_fields = ["subject_id", "name"]
    readonly_fields = ["subject_type", "subject_id", "name", "value", "labels", "at"]

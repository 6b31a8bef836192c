from django.urls import path
from rest_framework.routers import SimpleRouter

from console.telemetry.api import trace_views

router = SimpleRouter()
router.register("telemetry/traces", trace_views.RequestTraceViewSet, basename="requesttrace")
urlpatterns = [
    *router.urls,
    path("telemetry/trace-batches/", trace_views.TraceBatchView.as_view(), name="trace-batches"),
]

from rest_framework.routers import SimpleRouter

from console.telemetry.api import trace_urls, views

router = SimpleRouter()
router.register("telemetry/samples", views.MetricSampleViewSet, basename="metricsample")
urlpatterns = router.urls + trace_urls.urlpatterns

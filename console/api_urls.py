"""Every app's API routes under /api/. Each app owns its own ``api/urls.py``."""

from django.urls import include, path

urlpatterns = [
    path("", include("console.core.api.urls")),
    path("", include("console.runs.api.urls")),
    path("", include("console.telemetry.api.urls")),
    path("", include("console.inventory.api.urls")),
    path("", include("console.catalog.api.urls")),
    path("", include("console.deployments.api.urls")),
    path("", include("console.rollouts.api.urls")),
    path("", include("console.planner.api.urls")),
    path("", include("console.schedules.api.urls")),
    path("", include("console.alerts.api.urls")),
    path("", include("console.drills.api.urls")),
    path("", include("console.gatewaykeys.api.urls")),
]

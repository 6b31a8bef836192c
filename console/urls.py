"""Top-level URL map: web console pages, the REST API under /api/, the admin, health,
metrics."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from console.core import views as core_views
from console.core.metrics import metrics_view

urlpatterns = [
    path("", core_views.overview, name="overview"),
    path("healthz", core_views.healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("assets/plotly.min.js", core_views.plotly_js, name="plotly-js"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("audit/", core_views.audit_log, name="audit-log"),
    path("security/", core_views.security, name="security"),
    path("", include("console.inventory.urls")),
    path("", include("console.catalog.urls")),
    path("", include("console.deployments.urls")),
    path("", include("console.runs.urls")),
    path("", include("console.drills.urls")),
    path("", include("console.rollouts.urls")),
    path("", include("console.schedules.urls")),
    path("", include("console.gatewaykeys.urls")),
    path("", include("console.alerts.urls")),
    path("", include("console.telemetry.urls")),
    path("planner/", include("console.planner.urls")),
    path("admin/", admin.site.urls),
    path("api/", include("console.api_urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path(
        "api/redoc/",
        # Without drf-spectacular's Google Fonts links: the docs pages need no CDN.
        SpectacularRedocView.as_view(url_name="schema", template_name="api/redoc.html"),
        name="api-redoc",
    ),
]

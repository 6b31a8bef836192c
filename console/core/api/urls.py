from django.urls import path
from rest_framework.routers import DefaultRouter

from console.core.api import views

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("audit-log", views.AuditLogViewSet, basename="auditlog")
router.register("users", views.UserViewSet, basename="user")

urlpatterns = [
    path("", views.api_root, name="api-root"),
    path("auth/token/", views.TokenObtainView.as_view(), name="api-token"),
    path("me/", views.me, name="api-me"),
    *router.urls,
]

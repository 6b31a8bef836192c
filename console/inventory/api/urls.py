from django.urls import path
from rest_framework.routers import DefaultRouter

from console.inventory.api import views

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("sites", views.SiteViewSet, basename="site")
router.register("nodes", views.NodeViewSet, basename="node")
router.register("links", views.LinkViewSet, basename="link")

urlpatterns = [
    path("heartbeats/", views.HeartbeatView.as_view(), name="heartbeat"),
    *router.urls,
]

from rest_framework.routers import DefaultRouter

from console.deployments.api import views

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("deployments", views.DeploymentViewSet, basename="deployment")
router.register("pools", views.PoolViewSet, basename="pool")

urlpatterns = router.urls

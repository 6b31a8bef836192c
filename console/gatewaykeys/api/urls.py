from rest_framework.routers import DefaultRouter

from console.gatewaykeys.api import views

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("gateway-keys", views.GatewayKeyViewSet, basename="gatewaykey")
# Only the gateway-access action: the deployments app serves the deployment itself.
router.register("deployments", views.DeploymentAccessViewSet, basename="deployment-access")

urlpatterns = router.urls

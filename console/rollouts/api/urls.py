from rest_framework.routers import DefaultRouter

from console.rollouts.api import views

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("rollout-plans", views.RolloutPlanViewSet, basename="rolloutplan")

urlpatterns = router.urls

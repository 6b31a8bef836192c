from rest_framework.routers import DefaultRouter

from console.alerts.api import views

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("alert-rules", views.AlertRuleViewSet, basename="alertrule")
router.register("alerts", views.AlertViewSet, basename="alert")
router.register("alert-channels", views.NotificationChannelViewSet, basename="alertchannel")

urlpatterns = router.urls

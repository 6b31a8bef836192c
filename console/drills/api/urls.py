from rest_framework.routers import DefaultRouter

from console.drills.api import views

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("drills", views.DrillViewSet, basename="drill")
router.register("drill-reports", views.DrillReportViewSet, basename="drillreport")

urlpatterns = router.urls

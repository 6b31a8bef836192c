from rest_framework.routers import DefaultRouter

from console.schedules.api import views

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("site-prices", views.SitePriceTableViewSet, basename="siteprice")
router.register("tidal-schedules", views.TidalScheduleViewSet, basename="tidalschedule")
router.register("tidal-applications", views.TidalApplicationViewSet, basename="tidalapplication")
router.register("rebalance-proposals", views.RebalanceProposalViewSet, basename="rebalanceproposal")

urlpatterns = router.urls

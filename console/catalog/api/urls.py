from rest_framework.routers import DefaultRouter

from console.catalog.api import views

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("models", views.ModelSpecViewSet, basename="modelspec")

urlpatterns = router.urls

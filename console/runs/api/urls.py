from rest_framework.routers import SimpleRouter

from console.runs.api import views

router = SimpleRouter()
router.register("runs", views.WorkflowRunViewSet, basename="run")
urlpatterns = router.urls

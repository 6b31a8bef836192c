from django.urls import path
from rest_framework.routers import DefaultRouter

from console.planner.api import views

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("planner/scenarios", views.PlannerScenarioViewSet, basename="plannerscenario")

urlpatterns = [
    path("planner/evaluate/", views.EvaluateView.as_view(), name="planner-evaluate"),
    path("planner/kv-size/", views.KvSizeView.as_view(), name="planner-kv-size"),
    path("planner/presets/", views.PresetsView.as_view(), name="planner-presets"),
    *router.urls,
]

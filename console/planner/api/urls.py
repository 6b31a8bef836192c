from django.urls import path

from console.planner.api import views

urlpatterns = [
    path("planner/evaluate/", views.EvaluateView.as_view(), name="planner-evaluate"),
    path("planner/kv-size/", views.KvSizeView.as_view(), name="planner-kv-size"),
    path("planner/presets/", views.PresetsView.as_view(), name="planner-presets"),
]

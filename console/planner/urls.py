from django.urls import path

from console.planner import views

urlpatterns = [
    path("", views.planner_page, name="planner"),
    path("plotly.min.js", views.plotly_js, name="planner-plotly-js"),
]

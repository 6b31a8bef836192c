from django.urls import path

from console.planner import views

urlpatterns = [
    path("", views.planner_page, name="planner"),
]

from django.urls import path

from console.telemetry import views

urlpatterns = [
    path("traces/", views.trace_list, name="traces-page"),
    path("traces/<int:pk>/", views.trace_detail, name="trace-page"),
]

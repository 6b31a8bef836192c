from django.urls import path

from console.drills import views

urlpatterns = [
    path("drills/", views.drill_list, name="drills-page"),
    path("drills/reports/<int:pk>/", views.report_detail, name="drill-report-page"),
]

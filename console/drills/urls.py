from django.urls import path

from console.drills import views

urlpatterns = [
    path("drills/", views.drill_list, name="drills-page"),
    path("drills/new/", views.drill_new, name="drill-page-new"),
    path("drills/<int:pk>/", views.drill_detail, name="drill-page"),
    path("drills/<int:pk>/edit/", views.drill_edit, name="drill-page-edit"),
    path("drills/reports/<int:pk>/", views.report_detail, name="drill-report-page"),
]

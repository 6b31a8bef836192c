from django.urls import path

from console.schedules import views

urlpatterns = [
    path("tidal/", views.tidal_list, name="tidal-page-list"),
    path("tidal/<int:pk>/", views.tidal_detail, name="tidal-page"),
]

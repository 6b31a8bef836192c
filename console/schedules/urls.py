from django.urls import path

from console.schedules import views

urlpatterns = [
    path("tidal/", views.tidal_list, name="tidal-page-list"),
    path("tidal/new/", views.tidal_new, name="tidal-page-new"),
    path("tidal/prices/", views.price_list, name="tidal-prices-page"),
    path("tidal/prices/<int:site_pk>/", views.price_save, name="tidal-prices-page-save"),
    path("tidal/<int:pk>/", views.tidal_detail, name="tidal-page"),
    path("tidal/<int:pk>/edit/", views.tidal_edit, name="tidal-page-edit"),
]

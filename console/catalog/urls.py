from django.urls import path

from console.catalog import views

urlpatterns = [
    path("models/", views.model_list, name="models-page"),
    path("models/<int:pk>/", views.model_detail, name="model-page"),
]

from django.urls import path

from console.runs import views

urlpatterns = [
    path("runs/", views.run_list, name="runs-page"),
    path("runs/start/", views.run_start, name="run-page-start"),
    path("runs/<int:pk>/", views.run_detail, name="run-page"),
    path("runs/<int:pk>/steps/", views.run_steps, name="run-page-steps"),
    path("runs/<int:pk>/cancel/", views.run_cancel, name="run-page-cancel"),
    path("runs/<int:pk>/retry/", views.run_retry, name="run-page-retry"),
]

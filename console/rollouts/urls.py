from django.urls import path

from console.rollouts import views

urlpatterns = [
    path("rollouts/", views.plan_list, name="rollout-plans-page"),
    path("rollouts/new/", views.plan_new, name="rollout-plan-page-new"),
    path("rollouts/step-row/", views.plan_step_row, name="rollout-plan-page-step"),
    path("rollouts/<int:pk>/", views.plan_detail, name="rollout-plan-page"),
    path("rollouts/<int:pk>/edit/", views.plan_edit, name="rollout-plan-page-edit"),
]

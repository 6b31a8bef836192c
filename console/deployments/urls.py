from django.urls import path

from console.deployments import canary_page, views

urlpatterns = [
    path("deployments/", views.deployment_list, name="deployments-page"),
    path("deployments/<int:pk>/", views.deployment_detail, name="deployment-page"),
    path(
        "deployments/<int:pk>/kill-switch/",
        views.deployment_kill_switch,
        name="deployment-page-kill-switch",
    ),
    path("deployments/<int:pk>/restore/", views.deployment_restore, name="deployment-page-restore"),
    path("canaries/", canary_page.canary_list, name="canaries-page"),
    path("canaries/<int:pk>/", canary_page.canary_detail, name="canary-page"),
    path("canaries/<int:pk>/actions/", canary_page.canary_actions, name="canary-page-actions"),
]

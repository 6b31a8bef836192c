from django.urls import path

from console.alerts import views

urlpatterns = [
    path("alerts/", views.alert_list, name="alerts-page"),
    path(
        "alerts/<int:pk>/acknowledge", views.alert_acknowledge_action, name="alert-page-acknowledge"
    ),
    path("alert-rules/<int:pk>/edit", views.alert_rule_edit_action, name="alert-rule-page-edit"),
]

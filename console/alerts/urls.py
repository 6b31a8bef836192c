from django.urls import path

from console.alerts import views

urlpatterns = [
    path("alerts/", views.alert_list, name="alerts-page"),
    path(
        "alerts/<int:pk>/acknowledge", views.alert_acknowledge_action, name="alert-page-acknowledge"
    ),
    path("alert-rules/new/", views.alert_rule_new, name="alert-rule-page-new"),
    path("alert-rules/<int:pk>/edit", views.alert_rule_edit_action, name="alert-rule-page-edit"),
    path(
        "alert-rules/<int:pk>/delete", views.alert_rule_delete_action, name="alert-rule-page-delete"
    ),
    path("alert-channels/new/", views.channel_new, name="alert-channel-page-new"),
    path("alert-channels/<int:pk>/edit/", views.channel_edit, name="alert-channel-page-edit"),
    path(
        "alert-channels/<int:pk>/enable",
        views.channel_enable_action,
        name="alert-channel-page-enable",
    ),
    path("alert-channels/<int:pk>/test", views.channel_test_action, name="alert-channel-page-test"),
    path(
        "alert-channels/<int:pk>/delete",
        views.channel_delete_action,
        name="alert-channel-page-delete",
    ),
]

from django.urls import path

from console.gatewaykeys import views

urlpatterns = [
    path("gateway-keys/", views.key_list, name="gateway-keys-page"),
    path("gateway-keys/create/", views.key_create, name="gateway-key-page-create"),
    path("gateway-keys/<int:pk>/revoke/", views.key_revoke, name="gateway-key-page-revoke"),
    path(
        "gateway-keys/deployments/<int:pk>/access/",
        views.access_update,
        name="gateway-access-page-update",
    ),
]

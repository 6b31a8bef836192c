from django.urls import path

from console.inventory import views

urlpatterns = [
    path("sites/", views.site_list, name="sites-page"),
    path("sites/<int:pk>/", views.site_detail, name="site-page"),
    path("nodes/", views.node_list, name="nodes-page"),
    path("nodes/<int:pk>/", views.node_detail, name="node-page"),
    path("nodes/<int:pk>/logs/<str:child>/", views.node_log, name="node-log-page"),
    path("links/", views.link_list, name="links-page"),
    path("links/<int:pk>/", views.link_detail, name="link-page"),
]

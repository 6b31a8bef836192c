"""A URL map with an extra per-deployment drill API action: the deployment page must show a
button for every routed action (and the readiness drill item must be computed)."""

from django.http import HttpRequest, JsonResponse
from django.urls import include, path


def _accepted(request: HttpRequest, pk: int) -> JsonResponse:
    return JsonResponse({"accepted": pk}, status=202)


urlpatterns = [
    path("api/deployments/<int:pk>/drill/", _accepted, name="deployment-drill"),
    path("", include("console.urls")),
]

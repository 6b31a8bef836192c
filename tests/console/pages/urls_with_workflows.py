"""A URL map with deploy / canary / drill API actions, as those features will add them: the
deployment page must show their buttons (and the readiness drill item must be computed)."""

from django.http import HttpRequest, JsonResponse
from django.urls import include, path


def _accepted(request: HttpRequest, pk: int) -> JsonResponse:
    return JsonResponse({"accepted": pk}, status=202)


urlpatterns = [
    path("api/deployments/<int:pk>/deploy/", _accepted, name="deployment-deploy"),
    path("api/deployments/<int:pk>/drill/", _accepted, name="deployment-drill"),
    path("", include("console.urls")),
]

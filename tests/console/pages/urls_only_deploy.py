"""A URL map with only the deploy API action: the deployment page's workflow buttons must
leave out the canary and drill buttons when their actions are not routed."""

from django.http import HttpRequest, JsonResponse
from django.urls import path


def _accepted(request: HttpRequest, pk: int) -> JsonResponse:
    return JsonResponse({"accepted": pk}, status=202)


urlpatterns = [path("api/deployments/<int:pk>/deploy/", _accepted, name="deployment-deploy")]

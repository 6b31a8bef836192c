"""API error conventions: ``detail`` for the message, field names for validation errors, and
no 500 for anything a client can send.

Database-level failures a client can provoke (a unique name taken twice, deleting an object
still in use) become 409 rather than 500; Django model validation errors become 400 naming
the field. Every error body is an object: ``console.core.api.schema`` describes the shapes
(``Error``, ``ValidationError``, ``Conflict``) for the OpenAPI schema.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import SuspiciousOperation
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError
from django.db.models import ProtectedError, RestrictedError
from rest_framework import status
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error
from rest_framework.settings import api_settings
from rest_framework.views import exception_handler as drf_exception_handler


class Conflict(APIException):
    """409: the request conflicts with the current state (stale version, object in use)."""

    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state."
    default_code = "conflict"


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, DjangoValidationError):
        return Response(as_serializer_error(exc), status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, SuspiciousOperation):
        # A body Django refuses to parse (too many form fields, too large): DRF would let it
        # through to Django's HTML 400 page.
        return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, ValidationError) and isinstance(exc.detail, list):
        # ``raise ValidationError("...")`` renders as a bare list; the schema promises an
        # object, so messages about the input as a whole go where serializers put them.
        exc = ValidationError({api_settings.NON_FIELD_ERRORS_KEY: exc.detail})
    if isinstance(exc, ProtectedError | RestrictedError):
        blocking = sorted({str(obj) for obj in list(exc.args[1])[:5]})
        return Response(
            {
                "detail": f"In use and cannot be deleted; still referenced by: {', '.join(blocking)}."
            },
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, IntegrityError):
        return Response(
            {"detail": "Conflicts with an existing object (a unique value is already taken)."},
            status=status.HTTP_409_CONFLICT,
        )
    return drf_exception_handler(exc, context)

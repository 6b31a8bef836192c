"""The OpenAPI schema tells the truth about errors.

``ConsoleAutoSchema`` (``REST_FRAMEWORK["DEFAULT_SCHEMA_CLASS"]``) adds to every operation the
error answers it can give, with the bodies ``console.core.api.exceptions.exception_handler``
renders, so no view has to decorate them one by one:

* 400 ``ValidationError`` for an operation with input (a request body, query or header
  parameters): field name -> messages, or ``detail`` for a body that is not JSON;
* 401 and 403 ``Error`` wherever authentication applies (no or bad credentials; a role too
  low, a missing CSRF token on a session write, a node outside the deployment);
* 404 ``Error`` for an operation with an id in its path, and for a list (a page past the end);
* 409 ``Conflict`` for writes on model-backed views (a stale version, an object in use, a
  unique value taken, a state that does not allow the action).

A view states the exceptions with ``schema_conflicts = False`` (its writes cannot conflict) or
``True`` (a view without a queryset whose writes can). Codes an ``@extend_schema(responses=...)``
already names are left as the view declared them.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers
from rest_framework.permissions import AllowAny

UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class ErrorSerializer(serializers.Serializer):
    """Every error that is not about one field: ``{"detail": "..."}``."""

    detail = serializers.CharField(help_text="What went wrong, for a person to read.")

    class Meta:
        ref_name = "Error"


class ConflictSerializer(serializers.Serializer):
    """409: the request conflicts with the current state."""

    detail = serializers.CharField(help_text="What conflicts, and what to do about it.")
    current_version = serializers.IntegerField(
        required=False,
        help_text="Only for a stale write: the deployment's version now (re-read, re-apply).",
    )

    class Meta:
        ref_name = "Conflict"


class ValidationErrorSerializer(serializers.Serializer):
    """400: bad input. Described by ``ValidationErrorSchema`` (a serializer cannot say "any
    field name"); never instantiated."""


class ValidationErrorSchema(OpenApiSerializerExtension):
    target_class = ValidationErrorSerializer

    def get_name(self, auto_schema: AutoSchema, direction: str) -> str:
        return "ValidationError"

    def map_serializer(self, auto_schema: AutoSchema, direction: str) -> dict[str, Any]:
        return {
            "type": "object",
            "description": (
                "Bad input. Each key names the field at fault (a body field, a query parameter "
                "such as `page_size` or a filter, or a header such as `If-Match`) with a list "
                "of messages; a nested object or list names its parts the same way. Errors "
                "about the input as a whole are under `non_field_errors`; a body that cannot "
                "be parsed at all is `detail`."
            ),
            "properties": {
                "detail": {"type": "string"},
                "non_field_errors": {"type": "array", "items": {"type": "string"}},
            },
            "additionalProperties": {
                "anyOf": [
                    {"type": "array", "items": {}},
                    {"type": "object"},
                ]
            },
        }


ERROR_RESPONSES: dict[str, tuple[type[serializers.Serializer], str]] = {
    "400": (ValidationErrorSerializer, "Bad input: the body names each field at fault."),
    "401": (ErrorSerializer, "No credentials or bad ones (see `WWW-Authenticate`)."),
    "403": (ErrorSerializer, "Authenticated, but not allowed (role too low, CSRF, node)."),
    "404": (ErrorSerializer, "No such object (or, for a list, a page past the end)."),
    "409": (ConflictSerializer, "Conflicts with the current state; nothing was written."),
}


class ConsoleAutoSchema(AutoSchema):
    """drf-spectacular's AutoSchema plus the error answers each operation can give."""

    def _get_response_bodies(self, direction: str = "response") -> dict[str, Any]:
        responses = super()._get_response_bodies(direction)
        for code in self.error_status_codes():
            if code in responses:
                continue
            serializer, description = ERROR_RESPONSES[code]
            responses[code] = self._get_response_for_code(
                OpenApiResponse(serializer, description), code, direction=direction
            )
        return responses

    def _get_filter_parameters(self) -> list[dict[str, Any]]:
        # A filter given with no value is a 400 (console.core.api.filters), so its text
        # parameters need at least one character; ``search`` alone may be empty (no search).
        parameters = super()._get_filter_parameters()
        for parameter in parameters:
            schema = parameter.get("schema", {})
            if (
                parameter.get("name") != "search"
                and schema.get("type") == "string"
                and not {"enum", "pattern", "format"} & schema.keys()
            ):
                schema["minLength"] = 1
        return parameters

    def error_status_codes(self) -> list[str]:
        """The error codes this operation documents, in order."""
        codes = []
        if self._has_input():
            codes.append("400")
        if self._needs_auth():
            codes += ["401", "403"]
        if self._path_has_id() or self._is_paginated_list():
            codes.append("404")
        if self._may_conflict():
            codes.append("409")
        return codes

    def _has_input(self) -> bool:
        if self.method in {"POST", "PUT", "PATCH"} and self.get_request_serializer() is not None:
            return True
        return any(p.get("in") != "path" for p in self._get_parameters())

    def _needs_auth(self) -> bool:
        return not all(isinstance(p, AllowAny) for p in self.view.get_permissions())

    def _path_has_id(self) -> bool:
        return "{" in self.path

    def _is_paginated_list(self) -> bool:
        return self.method == "GET" and self._is_list_view() and self._get_paginator() is not None

    def _may_conflict(self) -> bool:
        if self.method not in UNSAFE_METHODS:
            return False
        declared = getattr(self.view, "schema_conflicts", None)
        if declared is not None:
            return bool(declared)
        return getattr(self.view, "queryset", None) is not None

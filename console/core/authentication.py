"""User API token authentication: ``Authorization: Token <key>``, as with DRF's
``TokenAuthentication`` (same header, same 401s), but the key is looked up by its sha256
(``console.core.services_tokens``): the database never holds a usable token."""

from __future__ import annotations

from typing import Any

from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed

from console.core.models import ApiToken
from console.core.services_tokens import token_lookup


class ApiTokenAuthentication(TokenAuthentication):
    """``Authorization: Token <key>`` -> ``(user, ApiToken)``. A subclass of DRF's, so the
    header parsing, the ``WWW-Authenticate: Token`` challenge and the OpenAPI security
    scheme (``tokenAuth``) stay as they were."""

    model = ApiToken

    def authenticate_credentials(self, key: str) -> tuple[Any, ApiToken]:
        token = token_lookup(key)
        if token is None:
            raise AuthenticationFailed("Invalid token.")
        if not token.user.is_active:
            raise AuthenticationFailed("User inactive or deleted.")
        return token.user, token

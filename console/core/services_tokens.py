"""User API tokens: issue, revoke, and the lookup the API's token authentication makes. Only a
token's sha256 is stored (and its first characters, to tell tokens apart); the token itself is
returned once, by ``api_token_issue``. Every issue and revoke is audited, never with the token
or its hash. Called by the password exchange (``POST /api/auth/token/``), the admin and
``manage.py api_token_issue``. Blocking."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from django.db import transaction

from console.core.choices import AuditAction
from console.core.crud import Actor
from console.core.models import ApiToken
from console.core.services import audit_record

#: New tokens start with this, so a leaked one is recognisable (secret scanners), as node
#: tokens (``pdbn_``) and gateway keys (``pdbk_``) are.
KEY_PREFIX = "pdbu_"
PREFIX_CHARS = 12


def token_hash(token: str) -> str:
    """sha256 hex of a token (256-bit random tokens: a fast hash suffices; tokens from before
    hashing were 160-bit random, still far beyond guessing)."""
    return hashlib.sha256(token.encode()).hexdigest()


@transaction.atomic
def api_token_issue(*, actor: Actor, user: Any, name: str = "") -> tuple[ApiToken, str]:
    """Issue a new token for ``user`` (earlier ones stay valid until revoked). Returns the
    row and the token, which is stored only as its hash: this is the one time it can be read."""
    token = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken.objects.create(
        user=user,
        name=name[:100],
        token_hash=token_hash(token),
        token_prefix=token[:PREFIX_CHARS],
        created_by=actor if actor is not None and actor.is_authenticated else None,
    )
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="token_issue",
        instance=row,
        after={"user": user.get_username(), "name": row.name, "token_prefix": row.token_prefix},
    )
    return row, token


@transaction.atomic
def api_token_revoke(*, actor: Actor, token: ApiToken) -> None:
    """Revoke a token: its row is deleted, so the next request with it is a 401."""
    audit_record(
        actor=actor,
        action=AuditAction.DELETE,
        verb="token_revoke",
        instance=token,
        before={
            "user": token.user.get_username(),
            "name": token.name,
            "token_prefix": token.token_prefix,
        },
    )
    token.delete()


def token_lookup(token: str) -> ApiToken | None:
    """The row of a presented token, with its user, or None (one indexed query). Called by
    ``console.core.authentication.ApiTokenAuthentication`` on every API request."""
    if not token:
        return None
    return ApiToken.objects.select_related("user").filter(token_hash=token_hash(token)).first()

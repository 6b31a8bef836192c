"""Writes of gateway keys and key policies; each writes the audit log (never a key or its
hash: the name and prefix say which key)."""

from __future__ import annotations

import hashlib
import secrets

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from console.core.choices import AuditAction
from console.core.crud import Actor
from console.core.services import audit_record
from console.deployments.models import Deployment
from console.gatewaykeys.models import GatewayAccess, GatewayKey

#: Generated keys start with this, so a leaked one is recognisable (secret scanners).
KEY_PREFIX = "pdbk_"


def key_hash(key: str) -> str:
    """sha256 hex, as the gateway computes it (agents.gateway.access.key_hash)."""
    return hashlib.sha256(key.encode()).hexdigest()


def _user(actor: Actor) -> object | None:
    return actor if actor is not None and actor.is_authenticated else None


@transaction.atomic
def gateway_key_create(
    *, actor: Actor, deployment: Deployment, name: str
) -> tuple[GatewayKey, str]:
    """Create a client key for ``deployment``'s gateway. Returns the row and the key itself,
    which is stored only as its hash: this is the one time it can be read. A name already
    used by an active key of the deployment is a ValidationError on ``name``."""
    if GatewayKey.objects.filter(deployment=deployment, name=name, revoked_at=None).exists():
        raise ValidationError({"name": ["An active key of this deployment has this name."]})
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = GatewayKey(
        deployment=deployment,
        name=name,
        key_hash=key_hash(key),
        key_prefix=key[:12],
        created_by=_user(actor),
    )
    row.full_clean()
    row.save()
    audit_record(
        actor=actor,
        action=AuditAction.CREATE,
        instance=row,
        after={"deployment": deployment.pk, "name": name, "key_prefix": row.key_prefix},
    )
    return row, key


@transaction.atomic
def gateway_key_revoke(*, actor: Actor, key: GatewayKey) -> GatewayKey:
    """Revoke ``key`` (active -> revoked); the gateway refuses it from its next poll. A key
    already revoked is a ValidationError on ``revoked_at``."""
    key = GatewayKey.objects.select_for_update().get(pk=key.pk)
    if key.revoked_at is not None:
        raise ValidationError({"revoked_at": ["This key is already revoked."]})
    key.revoked_at = timezone.now()
    key.revoked_by = _user(actor)
    key.save(update_fields=["revoked_at", "revoked_by"])
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="revoke",
        instance=key,
        before={"revoked_at": None},
        after={"revoked_at": key.revoked_at.isoformat(), "key_prefix": key.key_prefix},
    )
    return key


@transaction.atomic
def gateway_access_update(
    *, actor: Actor, deployment: Deployment, require_client_keys: bool
) -> GatewayAccess:
    """Set whether ``deployment``'s gateway requires client keys (audited when it changes)."""
    access, _ = GatewayAccess.objects.select_for_update().get_or_create(deployment=deployment)
    if access.require_client_keys == require_client_keys:
        return access
    before = {"require_client_keys": access.require_client_keys}
    access.require_client_keys = require_client_keys
    access.save()
    audit_record(
        actor=actor,
        action=AuditAction.UPDATE,
        instance=access,
        before=before,
        after={"require_client_keys": require_client_keys},
    )
    return access

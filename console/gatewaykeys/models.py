"""Gateway client keys and each deployment's key policy. A key's plaintext is never stored:
only its sha256 (keys are 256-bit random, so a fast hash suffices) and its first characters,
to tell keys apart."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models

#: Key names become a metric label at the gateway: short and plain (the gateway checks the same).
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class GatewayKey(models.Model):
    """One client API key of a deployment's gateway. Active until revoked; a revoked key
    stays for the record (who made it, who revoked it, when)."""

    deployment = models.ForeignKey(
        "deployments.Deployment",
        # The keys exist only for the deployment's gateway: they go with it.
        on_delete=models.CASCADE,
        related_name="gateway_keys",
    )
    name = models.CharField(
        max_length=64,
        validators=[RegexValidator(NAME_RE, "1-64 letters, digits, '_', '.', '-'.")],
        help_text="Who holds the key; shown in the gateway's logs and metrics.",
    )
    key_hash = models.CharField(
        max_length=64,
        unique=True,
        help_text="sha256 hex of the key (the key itself is shown once, at creation).",
    )
    key_prefix = models.CharField(
        max_length=12,
        help_text="First characters of the key, to tell keys apart.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="gateway_keys_created",
    )
    created_at = models.DateTimeField(
        auto_now_add=True,
    )
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="gateway_keys_revoked",
    )
    revoked_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When set, the gateway refuses the key from its next config poll on.",
    )

    class Meta:
        ordering = ["deployment_id", "name", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment", "name"],
                condition=models.Q(revoked_at__isnull=True),
                name="gatewaykey_active_name_unique",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.key_prefix}...)"

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class GatewayAccess(models.Model):
    """A deployment's key policy: whether its gateway refuses requests without a valid key.
    No row means not required (existing deployments keep serving every client)."""

    deployment = models.OneToOneField(
        "deployments.Deployment",
        on_delete=models.CASCADE,
        related_name="gateway_access",
    )
    require_client_keys = models.BooleanField(
        default=False,
        help_text="The gateway answers 401 to requests without a valid client key.",
    )
    updated_at = models.DateTimeField(
        auto_now=True,
    )

    def __str__(self) -> str:
        required = "required" if self.require_client_keys else "optional"
        return f"client keys {required} for deployment {self.deployment_id}"

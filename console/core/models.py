from django.conf import settings
from django.db import models

from console.core.choices import AuditAction


class Timestamped(models.Model):
    """Abstract base: when a row was created and last changed."""

    created_at = models.DateTimeField(
        auto_now_add=True,
    )
    updated_at = models.DateTimeField(
        auto_now=True,
    )

    class Meta:
        abstract = True


class AuditLog(models.Model):
    """One write to the console: who, when, what, and the object before and after."""

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="audit_entries",
        help_text="The user who made the change (empty for system actions).",
    )
    actor_label = models.CharField(
        max_length=150,
        help_text="Username or system component at the time of the change (kept if the user is deleted).",
    )
    action = models.CharField(
        max_length=16,
        choices=AuditAction.choices,
    )
    verb = models.CharField(
        max_length=64,
        blank=True,
        help_text="For actions: what was done (restore, kill_switch, deploy ...).",
    )
    object_type = models.CharField(
        max_length=100,
        help_text="app_label.model of the changed object.",
    )
    object_id = models.CharField(
        max_length=64,
        blank=True,
    )
    object_repr = models.CharField(
        max_length=200,
        blank=True,
    )
    before = models.JSONField(
        null=True,
        blank=True,
    )
    after = models.JSONField(
        null=True,
        blank=True,
    )
    request_id = models.CharField(
        max_length=64,
        blank=True,
    )
    created_at = models.DateTimeField(
        auto_now_add=True,
        db_index=True,
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id"], name="audit_object_idx")]

    def __str__(self) -> str:
        return f"{self.actor_label} {self.action} {self.object_type}:{self.object_id}"


class ApiToken(models.Model):
    """A user's API token (``Authorization: Token <key>``), stored as its sha256 only, as node
    tokens and gateway client keys are: the key is shown once, when issued. A user may hold
    several (one per script or machine); deleting the row revokes it."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        # A token is the user's own credential: it goes with the account.
        on_delete=models.CASCADE,
        related_name="api_tokens",
    )
    name = models.CharField(
        max_length=100,
        blank=True,
        help_text="What the token is for (a script, a machine); shown with its prefix.",
    )
    token_hash = models.CharField(
        max_length=64,
        unique=True,
        help_text="sha256 hex of the token (tokens are random and long, so no slow hash is needed).",
    )
    token_prefix = models.CharField(
        max_length=12,
        help_text="First characters of the token, to tell tokens apart.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="api_tokens_issued",
        help_text="Who issued it (the user themself for a password exchange; empty: a command).",
    )
    created_at = models.DateTimeField(
        auto_now_add=True,
    )

    class Meta:
        ordering = ["user_id", "-created_at", "-id"]
        verbose_name = "API token"

    def __str__(self) -> str:
        label = f" {self.name}" if self.name else ""
        return f"{self.user.get_username()}'s token{label} ({self.token_prefix}...)"

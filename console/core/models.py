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

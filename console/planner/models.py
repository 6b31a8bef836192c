"""Saved planner scenarios: a named request body for ``POST /api/planner/evaluate/`` that
operators keep, compare and re-run (the deployment workflow's capacity step can point at one).
Only the inputs are stored; the answer is recomputed on demand (milliseconds), so it always
reflects the current model code and the current catalog model behind ``kv.model``."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from console.core.models import Timestamped
from console.inventory.models import name_validator


class PlannerScenario(Timestamped):
    """A named, validated planner scenario body (see ``console.planner.inputs``)."""

    name = models.CharField(
        max_length=63,
        unique=True,
        validators=[name_validator],
    )
    description = models.TextField(
        blank=True,
        help_text="What this scenario models and where its profiles come from.",
    )
    body = models.JSONField(
        help_text="The evaluate request body; validated on every write.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="planner_scenarios",
    )

    class Meta:
        ordering = ["name"]
        verbose_name = "planner scenario"

    def __str__(self) -> str:
        return self.name

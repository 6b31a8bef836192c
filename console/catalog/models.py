"""The model catalog: what a deployment serves, identified by its weights and architecture."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

from console.core.models import Timestamped
from console.inventory.models import name_validator


def validate_json_object(value: object) -> None:
    if not isinstance(value, dict):
        raise ValidationError("Must be a JSON object.")


class ModelSpecManager(models.Manager["ModelSpec"]):
    def get_by_natural_key(self, name: str) -> ModelSpec:
        return self.get(name=name)


class ModelSpec(Timestamped):
    """A model: its layer layout (``architecture``, validated by ``console.planner.kvsize``),
    its weights (URI and sha256) and engine settings. ``architecture_hash`` is computed by the
    services; together with ``weights_sha256`` it is the fingerprint the KV link checks."""

    name = models.CharField(
        max_length=63,
        unique=True,
        validators=[name_validator],
    )
    family = models.CharField(
        max_length=100,
        blank=True,
        help_text="Model family (qwen3.5, mimo-v2, ring-2.5, ...).",
    )
    architecture = models.JSONField(
        validators=[validate_json_object],
        help_text="Layer groups, see docs/data-model.md (validated by console.planner.kvsize).",
    )
    architecture_hash = models.CharField(
        max_length=64,
        editable=False,
        help_text="sha256 of the normalised architecture.",
    )
    parameter_count = models.PositiveBigIntegerField(
        validators=[MinValueValidator(1)],
        help_text="Total parameters (all experts).",
    )
    weights_uri = models.CharField(
        max_length=500,
        blank=True,
        help_text="Where the weights live (s3://, file://, hf://, ...).",
    )
    weights_sha256 = models.CharField(
        max_length=64,
        blank=True,
        help_text="sha256 of the weights; empty until the weights are registered (catalog shapes).",
        validators=[RegexValidator(r"^[0-9a-f]{64}$", "Expected 64 lower-case hex digits.")],
    )
    engine_settings = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_json_object],
        help_text="Engine options shared by every pool serving this model.",
    )
    notes = models.TextField(
        blank=True,
        help_text="Where the shape comes from, caveats.",
    )

    objects = ModelSpecManager()

    class Meta:
        ordering = ["name"]
        verbose_name = "model"

    def __str__(self) -> str:
        return self.name

    def natural_key(self) -> tuple[str]:
        return (self.name,)

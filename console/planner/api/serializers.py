"""Input serializers of the planner API. They validate and translate; the numbers come from the
pure modules (``inputs``, ``model``, ``demand``). ``PlannerInputError`` becomes a 400 whose key
is the offending field's dotted path (``remote.prefill.points[2]``)."""

from __future__ import annotations

import math
from typing import Any

from rest_framework import serializers

from console.catalog.models import ModelSpec
from console.core.api.fields import created_by_field
from console.planner.errors import PlannerInputError
from console.planner.inputs import parse_scenario
from console.planner.kvsize import ArchitectureError, validate_architecture
from console.planner.models import PlannerScenario
from console.planner.selectors import scenario_resolve


def field_error(exc: PlannerInputError) -> serializers.ValidationError:
    """A DRF validation error keyed by the field the planner named."""
    return serializers.ValidationError({exc.field or "non_field_errors": [exc.message]})


class ScenarioSerializer(serializers.Serializer):
    """A whole planner scenario (the body of ``POST /api/planner/evaluate/``); its schema is
    documented in ``console.planner.inputs`` and ``docs/planner.md``. ``validated_data`` holds
    ``{"scenario": Scenario}``."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        try:
            resolved, model = scenario_resolve(data)
            return {"scenario": parse_scenario(resolved), "model": model}
        except PlannerInputError as exc:
            raise field_error(exc) from None


class KvSizeSerializer(serializers.Serializer):
    """Body of ``POST /api/planner/kv-size/``: an architecture, prompt lengths, how many
    transfers run at once, the window they must finish in, and optionally the link."""

    architecture = serializers.JSONField(
        required=False, help_text="Architecture JSON (see console.planner.kvsize)."
    )
    model = serializers.PrimaryKeyRelatedField(
        queryset=ModelSpec.objects.all(),
        required=False,
        help_text="A catalog model id, instead of architecture.",
    )
    lengths = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=100_000_000),
        min_length=1,
        max_length=1000,
        help_text="Prompt lengths in tokens.",
    )
    concurrency = serializers.IntegerField(
        min_value=1, max_value=1_000_000, default=1, help_text="Transfers in flight at once."
    )
    window_s = serializers.FloatField(
        default=1.0, help_text="Tolerable transfer window per request, seconds (> 0)."
    )
    link_gbps = serializers.FloatField(
        required=False, allow_null=True, default=None, help_text="Link bandwidth, Gbit/s (> 0)."
    )
    utilisation_ceiling = serializers.FloatField(
        default=0.7, help_text="Share of the link KV may use, (0, 1]."
    )

    def validate_window_s(self, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise serializers.ValidationError("Must be > 0.")
        return value

    def validate_link_gbps(self, value: float | None) -> float | None:
        if value is not None and not value > 0:
            raise serializers.ValidationError("Must be > 0.")
        return value

    def validate_utilisation_ceiling(self, value: float) -> float:
        if not 0 < value <= 1:
            raise serializers.ValidationError("Must be in (0, 1].")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        model = attrs.pop("model", None)
        if (model is None) == ("architecture" not in attrs):
            raise serializers.ValidationError(
                {"architecture": ["Give exactly one of architecture or model."]}
            )
        if model is not None:
            attrs["architecture"] = model.architecture
            attrs["model"] = model
        try:
            attrs["architecture"] = validate_architecture(attrs["architecture"])
        except ArchitectureError as exc:
            raise serializers.ValidationError(
                {f"architecture.{exc.field}": [exc.message]}
            ) from None
        return attrs


class PlannerScenarioSerializer(serializers.ModelSerializer):
    """A saved scenario. ``body`` is validated by the services (errors keyed ``body.<field>``)."""

    created_by = created_by_field()

    class Meta:
        model = PlannerScenario
        fields = ["id", "name", "description", "body", "created_by", "created_at", "updated_at"]
        read_only_fields = ["created_by", "created_at", "updated_at"]

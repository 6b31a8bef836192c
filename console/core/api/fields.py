"""Serializer fields several apps share."""

from __future__ import annotations

from rest_framework import serializers


def username_field(source: str, help_text: str) -> serializers.CharField:
    """A user foreign key shown as the username: a nullable string (the keys are
    ``SET_NULL``, and the system acts with no user), never the user model's own field
    description."""
    return serializers.CharField(
        source=f"{source}.username", read_only=True, allow_null=True, help_text=help_text
    )


def created_by_field() -> serializers.CharField:
    """``created_by``: who made the object; ``null`` when the system did (beat, a workflow)
    or the user has since been deleted."""
    return username_field(
        "created_by", "Username of who made it; null when the system did or the user is gone."
    )

"""List filters that refuse what they cannot use: a bad value is a 400 naming the parameter,
never silently ignored.

django-filter already answers an unparsable value (``?since=yesterday``, ``?site=abc``) with a
400, but it drops a parameter given with no value (``?created_after=``), so a client that
meant to filter gets the whole list. DRF's ordering filter drops unknown fields. These
backends make both a 400 instead, and say so in the schema (``minLength: 1``; the ordering
fields as a pattern).
"""

from __future__ import annotations

import re
from datetime import UTC
from typing import Any

from django import forms
from django_filters.fields import IsoDateTimeField
from django_filters.filters import IsoDateTimeFilter
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework.exceptions import ValidationError
from rest_framework.filters import OrderingFilter, SearchFilter

BLANK = "This field may not be blank: leave the parameter out to not filter by it."


class UTCIsoDateTimeField(IsoDateTimeField):
    """An ISO 8601 date-time, converted to UTC here: Python accepts offsets up to +-23:59,
    PostgreSQL only up to +-15:59 (a query with ``+21:46`` was a 500), and an instant at
    the edge of the calendar that has no UTC equivalent is a 400, not an OverflowError."""

    def to_python(self, value: Any) -> Any:
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return parsed.astimezone(UTC)
        except OverflowError:
            raise forms.ValidationError(
                "Out of range once converted to UTC.", code="overflow"
            ) from None


class StrictFilterBackend(DjangoFilterBackend):
    """``DjangoFilterBackend`` that answers a filter given with no value with a 400 and
    compares date-times in UTC."""

    def get_filterset(self, request: Any, queryset: Any, view: Any) -> Any:
        filterset = super().get_filterset(request, queryset, view)
        for field in getattr(filterset, "filters", {}).values():  # this request's copies
            if isinstance(field, IsoDateTimeFilter):
                field.field_class = UTCIsoDateTimeField
        return filterset

    def filter_queryset(self, request: Any, queryset: Any, view: Any) -> Any:
        filterset_class = self.get_filterset_class(view, queryset)
        if filterset_class is not None:
            blank = {
                name: [BLANK]
                for name in filterset_class.base_filters
                if name in request.query_params and not request.query_params[name].strip()
            }
            if blank:
                raise ValidationError(blank)
        return super().filter_queryset(request, queryset, view)


def ordering_terms(view: Any) -> list[str] | None:
    """The view's ordering fields when they are an explicit list (the console's convention)."""
    fields = getattr(view, "ordering_fields", None)
    if not isinstance(fields, list | tuple):
        return None
    return [f if isinstance(f, str) else f[0] for f in fields]


class StrictOrderingFilter(OrderingFilter):
    """``?ordering=name,-id``: every term must be an ordering field of the view (or ``-``
    one); anything else is a 400 naming ``ordering`` and listing the fields."""

    def get_ordering(self, request: Any, queryset: Any, view: Any) -> Any:
        raw = request.query_params.get(self.ordering_param)
        if raw is None:
            return self.get_default_ordering(view)
        terms = [term.strip() for term in raw.split(",")]
        valid = {item[0] for item in self.get_valid_fields(queryset, view, {"request": request})}
        bad = [term for term in terms if term.removeprefix("-") not in valid]
        if bad:
            choices = ", ".join(sorted(valid))
            raise ValidationError(
                {self.ordering_param: [f"Cannot order by {bad[0]!r}; one of: {choices}."]}
            )
        return terms

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        terms = ordering_terms(view)
        if terms:
            one = "-?(" + "|".join(re.escape(t) for t in sorted(terms)) + ")"
            for parameter in parameters:
                parameter["description"] = (
                    "Comma-separated fields to order by, `-` for descending: "
                    + ", ".join(f"`{t}`" for t in sorted(terms))
                    + "."
                )
                parameter["schema"] = {"type": "string", "pattern": f"^{one}(,{one})*$"}
        return parameters


class StrictSearchFilter(SearchFilter):
    """DRF's search, with a bad term (a NUL character) named: ``{"search": [...]}`` rather
    than DRF's bare list."""

    def get_search_terms(self, request: Any) -> list[str]:
        try:
            return super().get_search_terms(request)
        except ValidationError as exc:
            raise ValidationError({self.search_param: exc.detail}) from None

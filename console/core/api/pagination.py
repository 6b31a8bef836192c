from __future__ import annotations

import re
from typing import Any

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination

_INTEGER = re.compile(r"[0-9]+")


def _positive(name: str, raw: str, maximum: int | None = None) -> int:
    """``raw`` as an integer in 1..maximum, else a 400 naming ``name``."""
    raw = raw.strip()
    if not _INTEGER.fullmatch(raw):
        raise ValidationError({name: ["A whole number is required."]})
    value = int(raw)
    if value < 1:
        raise ValidationError({name: ["Ensure this value is greater than or equal to 1."]})
    if maximum is not None and value > maximum:
        raise ValidationError({name: [f"Ensure this value is less than or equal to {maximum}."]})
    return value


class StandardPagination(PageNumberPagination):
    """Every list is paginated: ``?page=N&page_size=M`` (at most 500).

    A ``page`` or ``page_size`` that is not a whole number in range is a 400 naming it (DRF
    would fall back to the default size, or answer 404); a page past the end is DRF's 404
    ``Invalid page.``."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500

    def get_page_size(self, request: Any) -> int:
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return self.page_size
        return _positive(self.page_size_query_param, raw, self.max_page_size)

    def get_page_number(self, request: Any, paginator: Any) -> Any:
        raw = request.query_params.get(self.page_query_param)
        if raw is None:
            return 1
        if raw in self.last_page_strings:
            return paginator.num_pages
        return _positive(self.page_query_param, raw)

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        bounds = {
            self.page_query_param: {"minimum": 1},
            self.page_size_query_param: {"minimum": 1, "maximum": self.max_page_size},
        }
        for parameter in parameters:
            parameter["schema"].update(bounds.get(parameter["name"], {}))
        return parameters

"""The planner's one input error. Pure Python: the model raises it, the API turns it into a 400
whose key is ``field`` (a dotted JSON path such as ``remote.prefill.points[2]``)."""

from __future__ import annotations


class PlannerInputError(ValueError):
    """An invalid planner input. ``field`` names the offending value, ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def under(self, prefix: str) -> PlannerInputError:
        """The same error with its field nested under ``prefix`` (``lengths`` + ``sigma``)."""
        joined = f"{prefix}.{self.field}" if not self.field.startswith("[") else prefix + self.field
        return PlannerInputError(joined, self.message)

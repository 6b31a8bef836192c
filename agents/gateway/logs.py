"""Structured logs for the gateway: one JSON object per line, the event name as ``event``, the
call's ``extra`` fields, and the current request's id and client key name (from context
variables the request handler sets), so that a request can be followed through every line it
caused."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

#: The x-request-id of the request the current task serves ("" outside requests).
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
#: The name of the current request's client API key ("anonymous" when keys are optional and
#: it sent none; "" outside requests). Never the key itself.
client_key_var: contextvars.ContextVar[str] = contextvars.ContextVar("client_key", default="")

# Attributes every LogRecord has; anything else came from ``extra=``.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        request_id = request_id_var.get()
        if request_id:
            doc["request_id"] = request_id
        client_key = client_key_var.get()
        if client_key:
            doc["client_key"] = client_key
        for key, value in record.__dict__.items():
            if key not in _STANDARD:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(level: str = "INFO") -> None:
    """Send ``pdbridge.*`` logs to stderr as JSON lines (called by the CLI once)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("pdbridge")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False

"""The controller's identity towards node agents (mTLS), one place for everyone who calls
them: the workers (``orchestrator/agentops.py``) and the console's log page
(``console/inventory/agentlogs.py``)."""

from __future__ import annotations

from django.conf import settings

from grpc_kv.api import TLSConfig


class ControllerTlsMissing(ValueError):
    """The controller's identity towards agents is not configured (the message names it)."""


def controller_tls(server_name: str | None = None) -> TLSConfig:
    """The controller's TLS identity towards agents (settings ``PDBRIDGE_CONTROLLER_*``),
    shared by the workers (orchestrator/agentops.py) and the console's log page."""
    if settings.PDBRIDGE_CONTROLLER_INSECURE:
        return TLSConfig(insecure=True)
    names = (
        "PDBRIDGE_CONTROLLER_TLS_CA",
        "PDBRIDGE_CONTROLLER_TLS_CERT",
        "PDBRIDGE_CONTROLLER_TLS_KEY",
    )
    missing = [name for name in names if not getattr(settings, name)]
    if missing:
        raise ControllerTlsMissing(
            f"{missing[0]}: required to call agents (or PDBRIDGE_CONTROLLER_INSECURE)"
        )
    return TLSConfig(
        ca_file=settings.PDBRIDGE_CONTROLLER_TLS_CA,
        cert_file=settings.PDBRIDGE_CONTROLLER_TLS_CERT,
        key_file=settings.PDBRIDGE_CONTROLLER_TLS_KEY,
        server_name=server_name,
    )

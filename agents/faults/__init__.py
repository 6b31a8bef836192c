"""Drill faults: the record, the injector contract and the lazy registry.

A fault always carries an expiry. :class:`agents.faults.manager.FaultManager` journals it to
disk *before* applying it and restores it when it expires, on ``ClearFault``, on agent
shutdown and on agent start (whatever a crashed agent left behind).
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agents.config import FaultsConfig
    from agents.supervisor import Child
    from grpc_kv.faultproxy import FaultProxy, Toxic


class FaultError(Exception):
    """A fault cannot be injected or restored. ``field`` names the request field at fault,
    ``code`` is the gRPC status name the control API answers with."""

    def __init__(self, field_name: str, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.code = code


@dataclass
class Fault:
    """One injected fault as journalled on disk. ``details`` holds what restore needs
    (interface, namespace, addresses...) as resolved when it was applied, so a restarted agent
    undoes exactly what was done even if its config changed since."""

    id: str
    kind: str
    target: str
    params: dict[str, Any]
    created_at: str
    expires_at: str
    expires_epoch: float
    mechanism: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    state: str = "active"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fault:
        return cls(**data)


class FaultContext:
    """What injectors may touch: the faults config, the agent's children by name, its fault
    proxies by peer site, and the proxy toxics each active fault added (by fault id)."""

    def __init__(
        self,
        config: FaultsConfig,
        children: dict[str, Child],
        proxies: dict[str, FaultProxy] | None = None,
    ) -> None:
        self.config = config
        self.children = children
        self.proxies: dict[str, FaultProxy] = proxies if proxies is not None else {}
        self.toxics: dict[str, list[Toxic]] = {}


class FaultInjector(abc.ABC):
    """Applies and restores one kind of fault.

    Contract: called by the FaultManager on the event loop. ``prepare`` validates params and
    fills ``fault.mechanism`` / ``fault.details`` without side effects (it runs before the
    journal write); ``apply`` acts; ``restore`` undoes and must be idempotent and work from
    the journalled record alone (after an agent restart there may be no child, no config).
    Failures raise :class:`FaultError`.
    """

    @abc.abstractmethod
    def prepare(self, fault: Fault, ctx: FaultContext) -> None:
        """See the class docstring."""

    @abc.abstractmethod
    async def apply(self, fault: Fault, ctx: FaultContext) -> None:
        """See the class docstring."""

    @abc.abstractmethod
    async def restore(self, fault: Fault, ctx: FaultContext) -> None:
        """See the class docstring."""


INJECTORS: dict[str, str] = {
    "link_cut": "agents.faults.link:LinkCut",
    "link_degrade": "agents.faults.link:LinkDegrade",
    "engine_kill": "agents.faults.engine:EngineKill",
    "engine_restart": "agents.faults.engine:EngineRestart",
}


def injector(kind: str) -> FaultInjector:
    """The injector for ``kind``; FaultError naming ``kind`` if unknown."""
    target = INJECTORS.get(kind)
    if target is None:
        raise FaultError("kind", f"unknown fault kind {kind!r}; one of {', '.join(INJECTORS)}")
    module_name, _, attr = target.partition(":")
    result: FaultInjector = getattr(importlib.import_module(module_name), attr)()
    return result

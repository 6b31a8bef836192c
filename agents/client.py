"""Async client of the agent control API, used by the orchestrator, the CLI and tests.

Every call carries a deadline (``timeout`` per call, default per method) and every mutating
call a fresh request id unless the caller passes one (pass the same id to retry safely).
Failures raise ``grpc.aio.AioRpcError`` with the agent's status and message.
"""

from __future__ import annotations

import uuid
from typing import Any

from agents.proto.api import pb, pb_grpc
from grpc_kv.tls import TLSConfig

DEFAULT_TIMEOUT_S = 10.0
LAUNCH_TIMEOUT_S = 180.0


class AgentClient:
    """One channel to one agent. Use as ``async with AgentClient(address, tls) as agent:``;
    ``tls`` is a :class:`grpc_kv.tls.TLSConfig` with the controller's certificate
    (``server_name``: the agent's certificate name when dialing it by IP)."""

    def __init__(self, address: str, tls: TLSConfig) -> None:
        self.channel = tls.channel(address)
        self.stub = pb_grpc.AgentControlStub(self.channel)

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close(grace=None)

    @staticmethod
    def _rid(request_id: str | None) -> str:
        return request_id or uuid.uuid4().hex

    async def launch(
        self,
        kind: str,
        engine: str = "",
        settings: dict[str, Any] | None = None,
        name: str = "",
        config_version: int = 0,
        deployment_id: int = 0,
        request_id: str | None = None,
        timeout: float = LAUNCH_TIMEOUT_S,
    ) -> Any:
        from google.protobuf.struct_pb2 import Struct

        struct = Struct()
        struct.update(settings or {})
        request = pb.LaunchRequest(
            request_id=self._rid(request_id),
            name=name,
            kind=kind,
            engine=engine,
            settings=struct,
            config_version=config_version,
            deployment_id=deployment_id,
        )
        return await self.stub.Launch(request, timeout=timeout)

    async def stop(self, name: str, request_id: str | None = None, timeout: float = 60.0) -> Any:
        return await self.stub.Stop(
            pb.StopRequest(request_id=self._rid(request_id), name=name), timeout=timeout
        )

    async def restart(
        self, name: str, request_id: str | None = None, timeout: float = LAUNCH_TIMEOUT_S
    ) -> Any:
        return await self.stub.Restart(
            pb.RestartRequest(request_id=self._rid(request_id), name=name), timeout=timeout
        )

    async def status(self, name: str = "", timeout: float = DEFAULT_TIMEOUT_S) -> Any:
        return await self.stub.Status(pb.StatusRequest(name=name), timeout=timeout)

    async def logs(
        self, name: str, offset: int = 0, max_bytes: int = 0, timeout: float = DEFAULT_TIMEOUT_S
    ) -> Any:
        return await self.stub.Logs(
            pb.LogsRequest(name=name, offset=offset, max_bytes=max_bytes), timeout=timeout
        )

    async def inject_fault(
        self,
        kind: str,
        target: str,
        duration_s: float,
        params: dict[str, Any] | None = None,
        request_id: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> Any:
        from google.protobuf.struct_pb2 import Struct

        struct = Struct()
        struct.update(params or {})
        request = pb.InjectFaultRequest(
            request_id=self._rid(request_id),
            kind=kind,
            target=target,
            duration_s=duration_s,
            params=struct,
        )
        return await self.stub.InjectFault(request, timeout=timeout)

    async def clear_fault(
        self, fault_id: str = "", request_id: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
    ) -> Any:
        return await self.stub.ClearFault(
            pb.ClearFaultRequest(request_id=self._rid(request_id), id=fault_id), timeout=timeout
        )

    async def probe(
        self,
        peer_site: str,
        address: str,
        seconds: float = 3.0,
        max_bytes: int = 0,
        timeout: float = 90.0,
    ) -> Any:
        request = pb.ProbeRequest(
            peer_site=peer_site, address=address, seconds=seconds, max_bytes=max_bytes
        )
        return await self.stub.Probe(request, timeout=timeout)

    async def metrics(self, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
        return await self.stub.Metrics(pb.MetricsRequest(), timeout=timeout)

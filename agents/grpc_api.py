"""The gRPC control API (``pdbridge.agent.v1.AgentControl``) over :class:`AgentService`.

* mTLS through :class:`grpc_kv.tls.TLSConfig` (the same material and rules as the KV link;
  certificates reload without a restart): the server requires a client certificate signed by
  ``tls.ca``; the interceptor then admits only a caller whose identity -- its certificate's
  one subject common name, matched exactly; a SAN never counts -- is in
  ``tls.allowed_identities`` (:meth:`grpc_kv.tls.TLSConfig.check_peer`). ``--insecure``
  (explicit) serves plaintext, no allowlist.
* Deadlines: a call without one runs under ``default_deadline_s``.
* Idempotency: mutating calls require a ``request_id``; each runs once and to its end even
  when its caller goes away (killed, deadline passed); a retry with the same id gets the first
  call's answer (or waits for it while it is still in progress); the same id with a different
  request is refused.
* Errors: LaunchError / FaultError become their gRPC status with a message naming the field;
  anything else is INTERNAL with a generic message (the traceback stays in the agent log).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from agents.config import AgentConfig
from agents.faults import Fault, FaultError
from agents.launch import ChildSpec, LaunchError
from agents.proto.api import pb, pb_grpc
from agents.service import AgentService
from agents.supervisor import Child
from grpc_kv.tls import PeerRejected, TLSConfig

log = logging.getLogger("pdbridge.agent.grpc")

SERVICE = "pdbridge.agent.v1.AgentControl"
MUTATING = {"Launch", "Stop", "Restart", "InjectFault", "ClearFault"}
MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def struct_to_dict(struct: Struct) -> dict[str, Any]:
    """Struct -> dict, with integral numbers back as ints (Struct stores every number as a
    double)."""

    def fix(value: Any) -> Any:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value

    result: dict[str, Any] = fix(json_format.MessageToDict(struct))
    return result


def dict_to_struct(data: dict[str, Any]) -> Struct:
    struct = Struct()
    struct.update(data)
    return struct


class IdempotencyCache:
    """Mutating calls by (method, request id): each runs once, to completion, and its answer is
    kept ``ttl`` seconds after it finished (bounded by ``limit`` entries).

    A mutating call runs as a task of its own, not as part of the RPC that asked for it: when
    the caller goes away (its process killed, its deadline passed) the operation goes on, and
    the caller's retry with the same request id -- while it is still in progress or after it
    finished -- waits for and gets *that* operation's outcome. That is what makes a Launch
    at-most-once: a worker killed mid-Launch must not leave the resumed step starting the
    engine a second time. A call that failed is forgotten, so a retry runs it again.
    """

    def __init__(self, ttl: float, limit: int = 4096) -> None:
        self.ttl = ttl
        self.limit = limit
        # (method, request id) -> (finished at or started at, request digest, operation)
        self._entries: OrderedDict[tuple[str, str], tuple[float, str, asyncio.Task[Message]]] = (
            OrderedDict()
        )

    def _prune(self, now: float) -> None:
        # Oldest first; an entry still in flight stops the scan (it expires after it ends).
        while self._entries:
            stamp, _, task = next(iter(self._entries.values()))
            if not task.done() or stamp >= now - self.ttl:
                break
            self._entries.popitem(last=False)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def _finished(self, key: tuple[str, str], task: asyncio.Task[Message]) -> None:
        entry = self._entries.get(key)
        if entry is None or entry[2] is not task:
            return
        if task.cancelled() or task.exception() is not None:
            del self._entries[key]  # a failed call may be retried with the same id
        else:
            self._entries[key] = (time.monotonic(), entry[1], task)
            self._entries.move_to_end(key)

    async def run(
        self,
        method: str,
        request: Message,
        call: Callable[[], Awaitable[Message]],
        timeout: float,
    ) -> Message:
        """The outcome of ``call`` for this request id, waiting at most ``timeout`` seconds
        (TimeoutError after that; the operation itself goes on)."""
        request_id = getattr(request, "request_id", "")
        if not request_id:
            raise LaunchError("request_id", "required on mutating calls (retries reuse it)")
        digest = hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()
        self._prune(time.monotonic())
        key = (method, request_id)
        entry = self._entries.get(key)
        if entry is not None:
            if entry[1] != digest:
                raise LaunchError(
                    "request_id",
                    f"{request_id!r} was already used for a different {method} request",
                )
            task = entry[2]
            log.info(
                "agent.request_repeated",
                extra={"method": method, "request_id": request_id, "in_flight": not task.done()},
            )
        else:

            async def operation() -> Message:
                return await call()

            task = asyncio.create_task(operation(), name=f"{method}-{request_id}")
            self._entries[key] = (time.monotonic(), digest, task)
            task.add_done_callback(lambda done: self._finished(key, done))
        # shield: the caller's cancellation or deadline ends its wait, not the operation.
        return await asyncio.wait_for(asyncio.shield(task), timeout)


def _child_pb(child: Child) -> Any:
    return pb.ChildStatus(
        name=child.spec.name,
        kind=child.spec.kind,
        engine=child.spec.engine,
        state=child.state,
        pid=child.pid,
        port=child.plan.port,
        healthy=child.healthy and child.state == "running",
        uptime_s=child.uptime_s,
        restarts=child.restarts,
        config_version=child.spec.config_version,
        deployment_id=child.spec.deployment_id,
        last_exit=child.last_exit,
        health_url=child.plan.health_url,
        metrics_url=child.plan.metrics_url,
    )


def _fault_pb(fault: Fault) -> Any:
    return pb.Fault(
        id=fault.id,
        kind=fault.kind,
        target=fault.target,
        params=dict_to_struct(fault.params),
        mechanism=fault.mechanism,
        created_at=fault.created_at,
        expires_at=fault.expires_at,
        state=fault.state,
    )


class AgentControlServicer(pb_grpc.AgentControlServicer):
    """Translates the proto messages to :class:`AgentService` calls."""

    def __init__(self, service: AgentService) -> None:
        self.service = service

    async def Launch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        spec = ChildSpec(
            name=request.name or request.kind,
            kind=request.kind,
            engine=request.engine,
            settings=struct_to_dict(request.settings),
            config_version=request.config_version,
            deployment_id=request.deployment_id,
        )
        child, action = await self.service.launch(spec)
        return pb.LaunchResponse(child=_child_pb(child), action=action)

    async def Stop(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.StopResponse(child=_child_pb(await self.service.stop(request.name)))

    async def Restart(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.RestartResponse(child=_child_pb(await self.service.restart(request.name)))

    async def Status(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        service = self.service
        children = (
            [service.child(request.name)] if request.name else list(service.children.values())
        )
        return pb.StatusResponse(
            node=service.config.node.name,
            site=service.config.node.site,
            agent_version=service.heartbeat_body()["agent_version"],
            uptime_s=service.uptime_s,
            children=[_child_pb(c) for c in children],
            faults=[_fault_pb(f) for f in service.faults.active.values()],
        )

    async def Logs(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        data, offset, next_offset, start = self.service.logs(
            request.name, request.offset, request.max_bytes
        )
        return pb.LogsResponse(
            data=data, offset=offset, next_offset=next_offset, start_offset=start
        )

    async def Probe(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        from agents.probe import probe_peer

        result = await probe_peer(request, tls_config(self.service.config))
        return pb.ProbeResponse(**result)

    async def InjectFault(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        fault = await self.service.inject(
            request.kind, request.target, request.duration_s, struct_to_dict(request.params)
        )
        return pb.InjectFaultResponse(fault=_fault_pb(fault))

    async def ClearFault(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        cleared = await self.service.faults.clear(request.id)
        return pb.ClearFaultResponse(cleared=[_fault_pb(f) for f in cleared])

    async def Metrics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.service.refresh_metrics()
        return pb.MetricsResponse(
            agent=self.service.metrics.text(), child_urls=self.service.child_metrics_urls()
        )


class ControlInterceptor(grpc.aio.ServerInterceptor):
    """Allowlist, deadline, idempotency, error mapping and request metrics for every unary
    call of the control API."""

    def __init__(self, service: AgentService, tls: TLSConfig) -> None:
        self.service = service
        self.tls = tls
        self.default_deadline = service.config.default_deadline_s
        self.cache = IdempotencyCache(service.config.request_id_ttl_s)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        service_name, _, method = details.method.lstrip("/").partition("/")
        if handler is None or service_name != SERVICE or handler.unary_unary is None:
            return handler
        inner: Any = handler.unary_unary

        async def wrapped(request: Message, context: grpc.aio.ServicerContext) -> Message:
            code = grpc.StatusCode.OK
            try:
                try:
                    self.tls.authorize(context)
                except PeerRejected as exc:
                    code = grpc.StatusCode.PERMISSION_DENIED
                    log.warning(
                        "agent.caller_refused", extra={"method": method, "reason": str(exc)}
                    )
                    await context.abort(code, f"caller refused: {exc} of this agent")
                remaining = context.time_remaining()
                timeout = remaining if remaining is not None else self.default_deadline

                if method in MUTATING:
                    # Runs to its end even if this caller goes away; see IdempotencyCache.
                    return await self.cache.run(
                        method, request, lambda: inner(request, context), timeout
                    )
                result: Message = await asyncio.wait_for(inner(request, context), timeout)
                return result
            except (LaunchError, FaultError) as exc:
                code = grpc.StatusCode[exc.code]
                await context.abort(code, str(exc))
            except TimeoutError:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
                detail = f"{method} did not finish within its deadline"
                if method in MUTATING:
                    detail += "; it goes on: retry with the same request_id for its outcome"
                await context.abort(code, detail)
            except grpc.aio.AbortError:
                raise
            except Exception:
                code = grpc.StatusCode.INTERNAL
                log.exception("agent.rpc_failed", extra={"method": method})
                await context.abort(code, f"{method} failed inside the agent (see its log)")
            finally:
                self.service.metrics.requests.labels(method=method, code=code.name).inc()
            raise AssertionError("unreachable")  # abort() always raises

        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def tls_config(config: AgentConfig) -> TLSConfig:
    """The control API's TLS settings from the agent config (ValueError naming the field)."""
    if config.insecure:
        return TLSConfig.development()
    return TLSConfig(
        ca_file=Path(config.tls.ca),
        cert_file=Path(config.tls.cert),
        key_file=Path(config.tls.key),
        # An empty allowlist refuses every caller (None would admit any CA-signed one).
        allowed_peers=list(config.tls.allowed_identities),
    )


async def start_server(service: AgentService) -> tuple[grpc.aio.Server, int]:
    """Build and start the control API server; returns it and the bound port."""
    config = service.config
    tls = tls_config(config)
    server = grpc.aio.server(
        interceptors=[ControlInterceptor(service, tls)],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ],
    )
    pb_grpc.add_AgentControlServicer_to_server(AgentControlServicer(service), server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = tls.add_port(server, config.listen)
    await server.start()
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port

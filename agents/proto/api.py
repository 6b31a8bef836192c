"""The generated messages and stubs of ``pdbridge.agent.v1``, generated on first import."""

from __future__ import annotations

from agents.proto import ensure_generated

ensure_generated()

from agents.proto.pdbridge.agent.v1 import agent_pb2 as pb  # noqa: E402
from agents.proto.pdbridge.agent.v1 import agent_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]

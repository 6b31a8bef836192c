"""Reading a supervised process's log through its node's agent, for the console's log page.

The agent keeps each child's log as one size-rotated byte stream (``agents/logs.py``) and
serves byte ranges of it over its control API (``Logs``, mTLS). The console asks for the last
``size`` bytes before an offset, keeps whole lines only and, when given a search text, the
lines that contain it: how an operator follows one request id from a trace into each site's
logs without a shell on the node.

The web process calls the agent with the controller's identity (``PDBRIDGE_CONTROLLER_*``,
the one the workers use); an agent that does not answer within ``TIMEOUT_S`` is an error on
the page, never a hung request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import grpc
from asgiref.sync import async_to_sync

from agents.client import AgentClient
from console.core.controller import ControllerTlsMissing, controller_tls

#: How long the page waits for the agent.
TIMEOUT_S = 8.0
#: Sizes of the tail an operator can read at once (the agent serves at most 1 MiB a call).
SIZES = {"64k": 64 * 1024, "256k": 256 * 1024, "1m": 1024 * 1024}
DEFAULT_SIZE = "256k"
#: Longest search text (a request id is 32 hex characters; a transfer id a little longer).
MAX_SEARCH = 200
#: Child names as the agent reports them (``ChildSpec.name``).
CHILD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def process_names(reported: object, kind: str | None = None) -> list[str]:
    """The names of the processes a node's heartbeat reported (``Node.reported_children``),
    of ``kind`` when given, that the log page can name (others are left out, not a 500)."""
    return [
        str(c["name"])
        for c in (reported if isinstance(reported, list) else [])
        if isinstance(c, dict)
        and CHILD_NAME.match(str(c.get("name", "")))
        and (kind is None or c.get("kind") == kind)
    ]


class LogUnavailable(Exception):
    """The agent could not give the log: ``status`` is the page's HTTP status (404 unknown
    child, 502 agent refused or failed, 503 not configured, 504 no answer in time)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class LogExcerpt:
    """Whole lines of ``[offset, end)`` of a child's log stream, those containing ``search``
    when one was given (``matched`` of ``total`` lines read)."""

    lines: list[str]
    offset: int
    end: int
    start_offset: int
    total: int
    search: str
    matched: int = 0
    #: Offset to pass as ``before`` to read the bytes before these (None: nothing older).
    earlier: int | None = None
    sizes: list[str] = field(default_factory=lambda: list(SIZES))


async def _read(address: str, hostname: str, child: str, offset: int, size: int) -> object:
    async with AgentClient(address, controller_tls(hostname)) as agent:
        return await agent.logs(child, offset, size, timeout=TIMEOUT_S)


def read_log(
    *, address: str, hostname: str, child: str, size: int, before: int | None, search: str
) -> LogExcerpt:
    """The last ``size`` bytes of ``child``'s log before offset ``before`` (None: its end),
    through the agent at ``address`` (certificate name ``hostname``); raises LogUnavailable."""
    offset = -size if before is None else max(0, before - size)
    want = size if before is None else before - offset
    try:
        reply = async_to_sync(_read)(address, hostname, child, offset, max(want, 1))
    except ControllerTlsMissing as exc:
        raise LogUnavailable(503, str(exc)) from None
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.NOT_FOUND:
            raise LogUnavailable(404, f"the agent supervises no process {child!r}") from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise LogUnavailable(
                504, f"the agent at {address} did not answer in {TIMEOUT_S:g} s"
            ) from None
        raise LogUnavailable(
            502, f"the agent at {address} answered {code.name}: {exc.details() or 'no details'}"
        ) from None
    data = bytes(reply.data)[: max(want, 0)]  # type: ignore[attr-defined]
    first: int = reply.offset  # type: ignore[attr-defined]
    start: int = reply.start_offset  # type: ignore[attr-defined]
    end = first + len(data)
    newline = data.find(b"\n")
    if first > start and 0 <= newline < len(data) - 1:
        # The range began inside a line: drop its tail here, "earlier" reads it whole.
        data, first = data[newline + 1 :], first + newline + 1
    lines = data.decode("utf-8", errors="replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    total = len(lines)
    if search:
        lines = [line for line in lines if search in line]
    return LogExcerpt(
        lines=lines,
        offset=first,
        end=end,
        start_offset=start,
        total=total,
        search=search,
        matched=len(lines),
        earlier=first if first > start else None,
    )

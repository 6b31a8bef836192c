"""Rotating child logs read by offset across rotations, alone and through a real agent."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from agents.logs import RotatingLog
from agents.proto.api import pb
from tests.agents.conftest import HEALTHSERVER, AgentProc, agent_config, stub

# Ten 2000-byte bursts of output, then the health server (exec: same process).
CHATTY = [
    "sh", "-c",
    'for i in 0 1 2 3 4 5 6 7 8 9; do head -c 1999 /dev/zero | tr "\\0" "$i"; echo; '
    'sleep 0.05; done; exec "$0" "$@"',
    *HEALTHSERVER,
]  # fmt: skip


def test_offsets_survive_rotation(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "c.log", max_bytes=10, backups=2)
    for i in range(6):
        log.write(f"line{i}....\n".encode())  # 10 bytes: every write rotates
    assert log.end == 60
    assert log.start == 40  # 2 backups of 10 bytes kept (line4, line5); current is empty
    data, first = log.read(0, 100)
    assert first == 40
    assert data == b"line4....\nline5....\n"
    data, first = log.read(45, 7)
    assert (data, first) == (b"....\nli", 45)
    data, first = log.read(-4, 100)
    assert (data, first) == (b"...\n", 56)
    log.close()


def test_reopen_continues_the_stream(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "c.log", max_bytes=1000, backups=1)
    log.write(b"hello\n")
    log.close()
    again = RotatingLog(tmp_path / "c.log", max_bytes=1000, backups=1)
    again.write(b"world\n")
    assert again.read(0, 100) == (b"hello\nworld\n", 0)
    again.close()


def test_agent_rotates_a_childs_log_and_logs_pages_across_it(
    agent_factory: Callable[..., AgentProc], tmp_path: Path
) -> None:
    config = agent_config(
        tmp_path,
        None,
        supervision={"log_max_bytes": 4000, "log_backups": 2},
        engines={"chatty": {"argv": CHATTY}},
    )
    agent = agent_factory(config)
    request = pb.LaunchRequest(request_id=os.urandom(8).hex(), name="talk", kind="decode-engine",
                               engine="chatty")  # fmt: skip
    stub(agent, None).Launch(request, timeout=60)
    logs = agent.state_dir / "logs"
    assert (logs / "talk.log.1").exists()  # 20 KB written, 4 KB per file: rotated...
    assert not (logs / "talk.log.3").exists()  # ...keeping log_backups files
    page = stub(agent, None).Logs(pb.LogsRequest(name="talk", offset=0), timeout=30)
    assert page.start_offset > 0  # the oldest bytes were rotated away
    assert page.offset == page.start_offset
    assert b"healthserver pid=" in page.data  # the newest output is all there
    on_disk = sum(p.stat().st_size for p in logs.glob("talk.log*"))
    assert len(page.data) == on_disk

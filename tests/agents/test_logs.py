"""Rotating child logs read by offset across rotations."""

from __future__ import annotations

from pathlib import Path

from agents.logs import RotatingLog


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

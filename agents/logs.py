"""Size-rotated log files of supervised children, readable by byte offset (``Logs`` RPC).

A child's log is one logical byte stream: ``<name>.log.<n>`` (oldest) ... ``<name>.log.1``,
``<name>.log`` (newest). Offsets count bytes since the first byte still on disk when the
agent started, so a reader can page with ``next_offset`` across rotations. Writes are small
blocking appends from the event loop (a local disk write of at most 64 KiB).
"""

from __future__ import annotations

from pathlib import Path


class RotatingLog:
    """Append-only, size-rotated log file. Used by :class:`agents.supervisor.Child`."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        path.parent.mkdir(parents=True, exist_ok=True)
        self._end = sum(size for _, size in self._files())
        self._fh = path.open("ab")

    def _files(self) -> list[tuple[Path, int]]:
        """Existing files, oldest first, with their sizes."""
        paths = [self.path.with_name(f"{self.path.name}.{n}") for n in range(self.backups, 0, -1)]
        paths.append(self.path)
        return [(p, p.stat().st_size) for p in paths if p.exists()]

    @property
    def end(self) -> int:
        return self._end

    @property
    def start(self) -> int:
        return self._end - sum(size for _, size in self._files())

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._fh.write(data)
        self._fh.flush()
        self._end += len(data)
        if self._fh.tell() >= self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        self._fh.close()
        oldest = self.path.with_name(f"{self.path.name}.{self.backups}")
        oldest.unlink(missing_ok=True)
        for n in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{n}")
            if src.exists():
                src.rename(self.path.with_name(f"{self.path.name}.{n + 1}"))
        self.path.rename(self.path.with_name(f"{self.path.name}.1"))
        self._fh = self.path.open("ab")

    def read(self, offset: int, max_bytes: int) -> tuple[bytes, int]:
        """Up to ``max_bytes`` from ``offset`` (negative: that many bytes before the end).

        Returns ``(data, offset_of_first_byte)``; an offset older than what is on disk starts
        at the oldest byte still there.
        """
        if offset < 0:
            offset = max(self._end + offset, 0)
        files = self._files()
        position = self._end - sum(size for _, size in files)
        offset = max(offset, position)
        first = offset
        chunks: list[bytes] = []
        wanted = max_bytes
        for path, size in files:
            if wanted <= 0:
                break
            if offset < position + size:
                with path.open("rb") as fh:
                    fh.seek(offset - position)
                    data = fh.read(min(wanted, position + size - offset))
                chunks.append(data)
                wanted -= len(data)
                offset += len(data)
            position += size
        return b"".join(chunks), first

    def close(self) -> None:
        self._fh.close()

"""Protobuf wire format by hand, for the one field that is megabytes: a Chunk's payload.

The sender appends the payload to the serialised small fields itself (one copy, not three);
the receiver cuts it out of the received frame as a zero-copy view and lets protobuf parse
only the small fields (parsing the whole frame would copy the payload twice: into the
message, and again on every read of ``chunk.payload``). Pure functions, non-blocking;
a malformed frame raises :class:`FrameError` (the receiver answers INVALID_ARGUMENT).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from grpc_kv.codec import Checksum, Codec, checksum, compress

#: Chunk.payload: field 9, length-delimited.
CHUNK_PAYLOAD_FIELD = 9
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class FrameError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def varint(value: int) -> bytes:
    """Protobuf base-128 varint (frames assembled by hand around big payloads)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def with_field(small: bytes, field: int, value: bytes | memoryview) -> bytes:
    """A serialised message: ``small`` (its other fields, serialised by protobuf) followed by
    length-delimited ``field`` = ``value``, which is copied once (protobuf would copy it into
    the message and again when serialising)."""
    return b"".join((small, varint(field << 3 | _LENGTH), varint(len(value)), value))


def read_varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``; FrameError when truncated."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise FrameError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def split_field(frame: bytes, field: int) -> tuple[bytes, memoryview]:
    """Cut length-delimited ``field`` out of a serialised message: (every other field's
    bytes, a view of the field's value; empty when absent). The last occurrence wins, as
    protobuf's own parser does. Walks only tags and lengths, so a multi-megabyte value costs
    nothing; raises FrameError on a truncated or malformed frame."""
    view = memoryview(frame)
    rest: list[memoryview] = []
    value = view[0:0]
    pos = 0
    while pos < len(view):
        start = pos
        tag, pos = read_varint(view, pos)
        kind = tag & 7
        if kind == _VARINT:
            _, pos = read_varint(view, pos)
        elif kind == _FIXED64:
            pos += 8
        elif kind == _FIXED32:
            pos += 4
        elif kind == _LENGTH:
            length, pos = read_varint(view, pos)
            if tag >> 3 == field:
                if pos + length > len(view):
                    raise FrameError("length-delimited field runs past the frame")
                value = view[pos : pos + length]
                pos += length
                continue
            pos += length
        else:
            raise FrameError(f"unsupported wire type {kind}")
        if pos > len(view):
            raise FrameError("field runs past the frame")
        rest.append(view[start:pos])
    if len(rest) == 1:
        return bytes(rest[0]), value
    return b"".join(rest), value


@dataclass(eq=False, repr=False)  # identity semantics: frames are megabytes
class OutChunk:
    """A chunk on the sender's side: its frame and bookkeeping (attempts, connection)."""

    seq: int
    #: The encoded frame; or, for a slice of an immutable ``bytes`` sent uncompressed,
    #: the frame's small fields + payload view, framed at each write (see ``frame``).
    encoded: bytes | tuple[bytes, memoryview]
    raw: int
    wire: int
    checksum: int
    attempts: int = 0
    sends: int = 0
    conn: int = -1
    queued: bool = False
    #: Bulk data path, uncompressed: (Chunk head without its checksum, checksum kind,
    #: checksum seed, callback(seq, checksum)). The checksum is computed when the chunk is
    #: first written (see ``bulk_parts``), not when it is queued.
    deferred: Any = None

    def frame(self) -> bytes:
        """The bytes to write. A lazily framed chunk is copied here, just before grpc copies
        it again, and freed right after: the copy lands in memory malloc just freed rather
        than in fresh pages the kernel must fault in and zero (half the sender's CPU on
        loopback when every queued chunk held its own frame)."""
        if isinstance(self.encoded, bytes):
            return self.encoded
        head, payload = self.encoded
        return with_field(head, CHUNK_PAYLOAD_FIELD, payload)

    def bulk_parts(self) -> tuple[bytes, memoryview]:
        """``parts`` for the bulk data path, computing a deferred checksum first. Called by
        the writer (a worker thread, for plaintext) just before the payload is written:
        the checksum pulls the chunk into the CPU cache, so the kernel's copy that follows
        reads it from there instead of from memory a second time, and neither runs on the
        event loop (xxhash releases the GIL). Never called for one chunk concurrently."""
        if self.deferred is not None:
            head, kind, seed, record = self.deferred
            _, payload = self.parts()
            head.checksum = checksum(kind, payload, seed)
            self.checksum = int(head.checksum)
            self.encoded = (head.SerializeToString(), payload)
            record(self.seq, self.checksum)
            self.deferred = None
        return self.parts()

    def parts(self) -> tuple[bytes, memoryview]:
        """(the small fields, a view of the payload) for the bulk data path, which writes
        them as they are: a lazily framed chunk is not copied at all; an encoded frame is
        only cut (the head copied, a few dozen bytes)."""
        if isinstance(self.encoded, bytes):
            return split_field(self.encoded, CHUNK_PAYLOAD_FIELD)
        head, payload = self.encoded
        return head, payload


def encode_chunk(
    data: memoryview,
    codec: Codec,
    level: int,
    kind: Checksum,
    head: Any,
    lazy: bool,
    seed: int,
) -> tuple[bytes | tuple[bytes, memoryview], int, float]:
    """Build a Chunk frame (blocking): the small fields through protobuf, the payload
    appended by hand so that uncompressed data is copied once, not three times; with
    ``lazy`` (uncompressed slice of immutable bytes) not at all until it is written.
    ``seed``: the chunk's :func:`grpc_kv.codec.chunk_seed`, which the checksum covers.
    Returns (encoded, payload length, seconds spent compressing)."""
    start = time.perf_counter()
    payload: bytes | memoryview = data if codec is Codec.NONE else compress(codec, data, level)
    spent = time.perf_counter() - start
    head.checksum = checksum(kind, data, seed)
    small = head.SerializeToString()
    if lazy and codec is Codec.NONE:
        return (small, data), len(data), spent
    return with_field(small, CHUNK_PAYLOAD_FIELD, payload), len(payload), spent

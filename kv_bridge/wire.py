"""Wire rules shared by the bridge's server and client: version, sizes, framing and reassembly.

A chunk's bytes are cut into frames of at most frame_bytes; the receiver (Assembler) accepts
frames strictly in order and releases a chunk only when its last byte arrived, so an
interrupted stream can never surface a partial entry. MACs are checked by the store. A chunk
announcing more than max_chunk_bytes is refused on its first frame, before a byte is kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb

PROTOCOL_VERSION = 1
DEFAULT_FRAME_BYTES = 1 << 20  # 1 MiB: large enough to amortise per-message cost, small for flow control
MIN_FRAME_BYTES = 4 << 10
MAX_FRAME_BYTES = 32 << 20
MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + (1 << 20)  # a frame plus its key and fields
DEFAULT_MAX_CHUNK_BYTES = 1 << 30  # without a model's layout; a service passes chunk.max_chunk_bytes(layout)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class FrameError(ValueError):
    """A frame that breaks the framing rules; `field` names the offending field for the reply."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def clamp_frame_bytes(n: int) -> int:
    return DEFAULT_FRAME_BYTES if n <= 0 else max(MIN_FRAME_BYTES, min(MAX_FRAME_BYTES, n))


def frame_spans(data: bytes, frame_bytes: int) -> Iterator[tuple[int, bytes, bool]]:
    """(offset, piece, last) of each frame of one chunk's bytes, in order."""
    total = len(data)
    if total <= frame_bytes:  # one frame: no slice copy
        yield 0, bytes(data), True
        return
    view = memoryview(data)
    for off in range(0, total, frame_bytes):
        end = min(off + frame_bytes, total)
        yield off, bytes(view[off:end]), end == total


def fill_frame(f: pb.ChunkFrame, key: str, offset: int, total: int, piece: bytes, last: bool) -> None:
    """Set a frame in place (inside its PutFrame/GetFrame): building a ChunkFrame and then
    assigning it to the outer message would copy the data once more."""
    f.key, f.offset, f.total_length, f.data, f.last = key, offset, total, piece, last


def split_frames(key: str, data: bytes, frame_bytes: int) -> Iterator[pb.ChunkFrame]:
    """The frames of one chunk as standalone messages (tests and tools; the RPCs use fill_frame)."""
    for off, piece, last in frame_spans(data, frame_bytes):
        f = pb.ChunkFrame()
        fill_frame(f, key, off, len(data), piece, last)
        yield f


@dataclass
class Assembler:
    """Reassembles frames into whole chunks, enforcing order; keeps at most one chunk in flight."""

    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    writable: bool = False  # hand out bytearrays (an importer's own buffers) instead of bytes (what stores keep)
    key: str = ""
    total: int = 0
    received: int = 0
    parts: list[bytes] = field(default_factory=list)

    @property
    def in_flight(self) -> str | None:
        """Key of a chunk started but not finished (dropped if the stream ends now)."""
        return self.key if self.key else None

    def feed(self, f: pb.ChunkFrame) -> tuple[str, bytes | bytearray] | None:
        """Accept one inline frame; returns (key, bytes) when it completes a chunk."""
        if not f.key:
            raise FrameError("frame.key", "empty")
        if self.key and f.key != self.key:
            raise FrameError("frame.key", f"got {f.key[:16]}... before chunk {self.key[:16]}... was complete")
        if f.offset != self.received:
            raise FrameError("frame.offset", f"expected {self.received}, got {f.offset} (frames must be in order)")
        if self.key and f.total_length != self.total:
            raise FrameError("frame.total_length", f"changed from {self.total} to {f.total_length} mid-chunk")
        if not 0 < f.total_length <= self.max_chunk_bytes:
            raise FrameError("frame.total_length", f"{f.total_length} not in 1..{self.max_chunk_bytes}")
        data = f.data  # read once: every access to a bytes field copies it out of the message
        end = f.offset + len(data)
        if end > f.total_length:
            raise FrameError("frame.data", f"ends at {end}, past total_length {f.total_length}")
        if f.last != (end == f.total_length):
            raise FrameError("frame.last", f"last={f.last} but {end} of {f.total_length} bytes received")
        if not data:
            raise FrameError("frame.data", "empty")
        self.key, self.total, self.received = f.key, f.total_length, end
        self.parts.append(data)
        if not f.last:
            return None
        # one copy either way; a bytearray lets KVChunk.from_bytes(own=True) keep it without another
        data = bytearray().join(self.parts) if self.writable else b"".join(self.parts)
        key = self.key
        self.key, self.total, self.received, self.parts = "", 0, 0, []
        return key, data

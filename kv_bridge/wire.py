"""Wire rules shared by the bridge's server and client: version, sizes, framing and reassembly.

A chunk's bytes are cut into frames of at most frame_bytes; the receiver (Assembler) accepts
frames strictly in order and releases a chunk only when its last byte arrived, so an
interrupted stream can never surface a partial entry. A chunk announcing more than
max_chunk_bytes is refused on its first frame, before a byte is kept. With a MAC key the
Assembler hashes each frame as it arrives (StreamingMac) and hands the digest on with the chunk:
the verifier then compares tags instead of reading the whole chunk again.

The messages that carry chunk bytes (PutFrame, GetFrame) go through the codec in frame_codec.py,
which writes and reads the protobuf encoding of kv_bridge.proto without copying the bytes into or
out of a message object.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Protocol, Sequence

import numpy as np

from flashpd.kv_bridge.auth import MacKey
from flashpd.kv_bridge.chunk import StreamingMac
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb

PROTOCOL_VERSION = 1
DEFAULT_FRAME_BYTES = 4 << 20  # per-message costs amortised; larger frames fall out of cache and pipeline worse
MIN_FRAME_BYTES = 4 << 10
MAX_FRAME_BYTES = 32 << 20
MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + (1 << 20)  # a frame plus its key and fields
DEFAULT_MAX_CHUNK_BYTES = 1 << 30  # without a model's layout; a service passes chunk.max_chunk_bytes(layout)
MAX_KEY_CHARS = 200  # a chunk key (a 64-digit digest) as the disk tier names a file after it
MAX_KEYS = 1 << 16  # keys in one Lookup or Get: a 1M-token prompt in 16-token chunks

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

Buffer = bytes | bytearray | memoryview


class FrameError(ValueError):
    """A frame that breaks the framing rules; `field` names the offending field for the reply."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def check_key(key: str, where: str) -> None:
    """A key is 1..MAX_KEY_CHARS characters: a client's key is echoed in replies and may name a file."""
    if not key:
        raise FrameError(where, "empty")
    if len(key) > MAX_KEY_CHARS:
        raise FrameError(where, f"{len(key)} characters, more than {MAX_KEY_CHARS}")


def clamp_frame_bytes(n: int) -> int:
    return DEFAULT_FRAME_BYTES if n <= 0 else max(MIN_FRAME_BYTES, min(MAX_FRAME_BYTES, n))


def frame_pieces(parts: Sequence[Buffer], frame_bytes: int) -> Iterator[tuple[int, list[memoryview], bool]]:
    """(offset, pieces, last) of each frame of the parts' concatenation, in order: the pieces are views
    of the parts (a frame may span several), so cutting frames copies nothing. No bytes: one empty
    frame (which a receiver refuses, as it must)."""
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(len(v) for v in views)
    if total == 0:
        yield 0, [], True
        return
    i, at, off = 0, 0, 0  # part index, position inside it, chunk offset
    while off < total:
        want, pieces = min(frame_bytes, total - off), []
        while want:
            v = views[i]
            n = min(want, len(v) - at)
            if n:
                pieces.append(v[at:at + n])
            at += n
            want -= n
            if at == len(v):
                i, at = i + 1, 0
        size = sum(len(p) for p in pieces)
        yield off, pieces, off + size == total
        off += size


def split_frames(key: str, data: bytes, frame_bytes: int) -> Iterator[pb.ChunkFrame]:
    """The frames of one chunk as standalone protobuf messages (tests and tools; the RPCs use frame_codec)."""
    for off, pieces, last in frame_pieces([data], frame_bytes):
        yield pb.ChunkFrame(key=key, offset=off, total_length=len(data), data=b"".join(pieces), last=last)


class BudgetExhausted(Exception):
    """A chunk's buffer would take the receiver's in-flight bytes past their bound (nothing was allocated)."""


class ByteBudget:
    """Bytes of chunks in flight (announced, buffered, not yet complete) across all of a receiver's streams:
    a store's budget counts a chunk only once it is complete, and each stream may hold one partial chunk
    as long as it keeps sending. One chunk alone always fits."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._used = 0

    @property
    def used(self) -> int:
        return self._used

    def acquire(self, n: int) -> bool:
        with self._lock:
            if self._used and self._used + n > self.max_bytes:
                return False
            self._used += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._used -= n


class InlineFrame(Protocol):
    """What the Assembler reads of a frame: a pb.ChunkFrame or a frame_codec.Frame."""

    key: str
    offset: int
    total_length: int
    data: Buffer
    last: bool


class Assembled(NamedTuple):
    key: str
    data: bytes | memoryview  # bytes, or (writable) a view of the receiver's own buffer
    body_mac: bytes | None  # the StreamingMac digest of the body when the Assembler had a MAC key
    lease: Any = None  # a chunk.Lease: data is a view of a bridge's arena, its own while the lease is valid


@dataclass
class Assembler:
    """Reassembles frames into whole chunks, enforcing order; keeps at most one chunk in flight.

    writable: each frame is copied once, as it arrives, into a buffer allocated from the chunk's
    announced length, and the chunk is a writable view of it that nobody else holds (an importer's
    tensors alias it; the bridge hands it to its store read-only). The copy runs without the GIL, so
    parallel streams overlap, and the buffer is numpy's (huge pages where the kernel offers them: far
    fewer page faults on fresh memory). Otherwise the frames' bytes are kept as views and joined once
    into immutable bytes at the end. mac: hash each frame on arrival; Assembled.body_mac carries the
    digest. budget: each chunk's announced length is taken from it on the chunk's first frame (before its
    buffer exists; BudgetExhausted when it does not fit) and given back when the chunk completes or on
    release(); `started` is when the chunk in flight began (time.monotonic), for a receiver's pace rule."""

    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    writable: bool = False
    mac: MacKey | None = None
    budget: ByteBudget | None = None
    # writable: where a chunk's buffer comes from first (a store's reserve(n): the put then needs no copy of its
    # own); None from it, or no alloc, means numpy's memory
    alloc: Callable[[int], np.ndarray | None] | None = None
    key: str = ""
    total: int = 0
    received: int = 0
    started: float = 0.0
    parts: list[Buffer] = field(default_factory=list)
    _buf: np.ndarray | None = None
    _hash: StreamingMac | None = None
    _held: int = 0

    @property
    def in_flight(self) -> str | None:
        """Key of a chunk started but not finished (dropped if the stream ends now)."""
        return self.key if self.key else None

    def feed(self, f: InlineFrame) -> Assembled | None:
        """Accept one inline frame; returns the chunk when this frame completes it."""
        check_key(f.key, "frame.key")
        if self.key and f.key != self.key:
            raise FrameError("frame.key", f"got {f.key[:16]}... before chunk {self.key[:16]}... was complete")
        if f.offset != self.received:
            raise FrameError("frame.offset", f"expected {self.received}, got {f.offset} (frames must be in order)")
        if self.key and f.total_length != self.total:
            raise FrameError("frame.total_length", f"changed from {self.total} to {f.total_length} mid-chunk")
        if not 0 < f.total_length <= self.max_chunk_bytes:
            raise FrameError("frame.total_length", f"{f.total_length} not in 1..{self.max_chunk_bytes}")
        data = f.data  # read once: on a pb.ChunkFrame every access copies the field out of the message
        end = f.offset + len(data)
        if end > f.total_length:
            raise FrameError("frame.data", f"ends at {end}, past total_length {f.total_length}")
        if f.last != (end == f.total_length):
            raise FrameError("frame.last", f"last={f.last} but {end} of {f.total_length} bytes received")
        if not data:
            raise FrameError("frame.data", "empty")
        if not self.key:  # the chunk's first frame, checked: now state is kept
            if self.budget is not None:
                if not self.budget.acquire(f.total_length):
                    raise BudgetExhausted(f"chunk {f.key[:16]}... of {f.total_length} bytes: the receiver has "
                                          f"{self.budget.used} bytes of chunks in flight, its bound is "
                                          f"{self.budget.max_bytes}")
                self._held = f.total_length
            self.key, self.total, self.started = f.key, f.total_length, time.monotonic()
            self._hash = StreamingMac(self.mac, self.total) if self.mac is not None else None
            if self.writable:  # not zeroed: every byte is written before the chunk is handed out
                self._buf = self.alloc(self.total) if self.alloc is not None else None
                if self._buf is None:
                    self._buf = np.empty(self.total, dtype=np.uint8)
        if self._hash is not None:
            self._hash.update(data)
        if self._buf is not None:  # numpy copies without the GIL: parallel streams overlap here
            self._buf[self.received:end] = np.frombuffer(data, dtype=np.uint8)
        else:
            self.parts.append(data)
        self.received = end
        if not f.last:
            return None
        out = memoryview(self._buf) if self._buf is not None else b"".join(self.parts)
        done = Assembled(self.key, out, self._hash.digest() if self._hash is not None else None)
        self.release()
        return done

    def release(self) -> None:
        """Drop the chunk in flight, if any, and give its bytes back to the budget (the stream ended)."""
        if self.budget is not None and self._held:
            self.budget.release(self._held)
        self.key, self.total, self.received, self.parts, self._buf, self._hash = "", 0, 0, [], None, None
        self._held, self.started = 0, 0.0

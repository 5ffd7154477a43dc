"""Client of the KV bridge: every call carries a deadline and the cluster's bearer token, and gRPC
failures become Python exceptions that say which call failed (timeouts are TimeoutErrors, an
unreachable bridge a ConnectionError, a refused token UNAUTHENTICATED). Chunks are sealed with the
cluster's MAC key on the way out; received chunks are verified (MAC, header, lengths, the key asked
for, and the reader's layout when given) before a tensor is built from them.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Literal

import grpc

from flashpd.kv_bridge import shm
from flashpd.kv_bridge.auth import ClusterSecret, resolve
from flashpd.kv_bridge.chunk import CorruptChunk, KVChunk, LayoutMismatch
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2_grpc as pb_grpc
from flashpd.kv_bridge.rpc_guard import with_token
from flashpd.kv_bridge.store import decode_checked
from flashpd.kv_bridge.tls import BridgeTls
from flashpd.kv_bridge.wire import (DEFAULT_FRAME_BYTES, DEFAULT_MAX_CHUNK_BYTES, GRPC_OPTIONS, PROTOCOL_VERSION,
                                    Assembler, FrameError, clamp_frame_bytes, fill_frame, frame_spans)

Transport = Literal["inline", "shm"]
_TRANSPORTS = {"inline": pb.INLINE, "shm": pb.SHM}


class BridgeError(Exception):
    """A bridge call failed; `call` names it, `code` is the gRPC status (None for client-side checks)."""

    def __init__(self, call: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"KVBridge.{call}: {message}")
        self.call = call
        self.code = code


class BridgeTimeout(BridgeError, TimeoutError):
    """The call's deadline passed (DEADLINE_EXCEEDED)."""


class BridgeUnavailable(BridgeError, ConnectionError):
    """The bridge could not be reached or went away (UNAVAILABLE)."""


class BridgeInvalidArgument(BridgeError, ValueError):
    """The server refused the request (INVALID_ARGUMENT); the message names the field."""


class BridgeUnauthenticated(BridgeError, PermissionError):
    """The bridge refused this client's token (UNAUTHENTICATED): not this cluster's secret."""


class BridgeProtocolError(BridgeError):
    """The server's reply broke the protocol (wrong version, frames out of order, wrong key)."""


@dataclass
class PutSummary:
    stored: int = 0
    duplicates: int = 0
    refused_keys: list[str] = field(default_factory=list)
    incomplete_keys: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refused_keys and not self.incomplete_keys


def _map_error(call: str, e: grpc.RpcError, timeout_s: float) -> BridgeError:
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(code)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return BridgeTimeout(call, f"deadline of {timeout_s:g} s exceeded", code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return BridgeUnavailable(call, f"bridge unavailable: {details}", code)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return BridgeInvalidArgument(call, details, code)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return BridgeUnauthenticated(call, details, code)
    return BridgeError(call, f"{code.name if code else 'error'}: {details}", code)


class BridgeClient:
    """One channel to one bridge. Thread-safe (gRPC channels are); close() when done.

    secret: the cluster's (default: this process's): its token goes with every call (the stub
    included), its MAC key seals and checks chunks. tls: verify the bridge's certificate against
    tls.ca (None: plaintext). max_chunk_bytes: the largest chunk a Get may hand this client."""

    def __init__(self, address: str, timeout_s: float = 30.0, frame_bytes: int = DEFAULT_FRAME_BYTES, *,
                 secret: ClusterSecret | None = None, tls: BridgeTls | None = None,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.frame_bytes = clamp_frame_bytes(frame_bytes)
        self.max_chunk_bytes = max_chunk_bytes
        secret = resolve(secret)
        self._mac = secret.mac_key
        self._channel = grpc.secure_channel(address, tls.channel_credentials(), options=GRPC_OPTIONS) \
            if tls is not None else grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = pb_grpc.KVBridgeStub(with_token(self._channel, secret.token))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "BridgeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _rpc(self, call: str, timeout_s: float) -> Iterator[None]:
        try:
            yield
        except grpc.RpcError as e:
            raise _map_error(call, e, timeout_s) from None

    def _check_version(self, call: str, version: int) -> None:
        if version != PROTOCOL_VERSION:
            raise BridgeProtocolError(call, f"reply version {version}, expected {PROTOCOL_VERSION}")

    # -- unary calls ----------------------------------------------------------------------------
    def lookup(self, keys: list[str], timeout_s: float | None = None) -> int:
        """Number of LEADING keys the bridge holds."""
        if not keys:
            return 0
        t = timeout_s or self.timeout_s
        with self._rpc("Lookup", t):
            r = self.stub.Lookup(pb.LookupRequest(version=PROTOCOL_VERSION, keys=keys), timeout=t)
        self._check_version("Lookup", r.version)
        return r.hits

    def stats(self, timeout_s: float | None = None) -> dict:
        t = timeout_s or self.timeout_s
        with self._rpc("Stats", t):
            r = self.stub.Stats(pb.StatsRequest(version=PROTOCOL_VERSION), timeout=t)
        self._check_version("Stats", r.version)
        return {"store": r.store, **dict(sorted(r.counters.items()))}

    def health(self, timeout_s: float | None = None) -> dict:
        t = timeout_s or self.timeout_s
        with self._rpc("Health", t):
            r = self.stub.Health(pb.HealthRequest(version=PROTOCOL_VERSION), timeout=t)
        self._check_version("Health", r.version)
        return {"serving": r.serving, "store": r.store}

    # -- Put ------------------------------------------------------------------------------------
    def put(self, chunks: Iterable[KVChunk], transport: Transport = "inline",
            timeout_s: float | None = None) -> PutSummary:
        """Stream chunks to the bridge (serialized lazily, one at a time; over shared memory the tensors'
        bytes go straight into the segment)."""
        if transport == "shm":
            return self.put_bytes(((c.key, c.to_parts(self._mac)) for c in chunks), transport, timeout_s)
        return self.put_bytes(((c.key, c.to_bytes(self._mac)) for c in chunks), transport, timeout_s)

    def put_bytes(self, items: Iterable[tuple[str, bytes | list[bytes | memoryview]]], transport: Transport = "inline",
                  timeout_s: float | None = None) -> PutSummary:
        """Stream already-serialized chunks (bytes, or for shm also a list of their parts in order); the
        server verifies each one and reports refusals."""
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
        t = timeout_s or self.timeout_s
        created: list[str] = []

        def frames() -> Iterator[pb.PutFrame]:
            for key, data in items:
                if transport == "shm":
                    name = shm.write_segment(data)
                    created.append(name)
                    size = sum(len(memoryview(p)) for p in data) if isinstance(data, list) else len(data)
                    yield pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
                        key=key, offset=0, total_length=size, last=True,
                        shm=pb.ShmHandle(name=name, length=size)))
                else:
                    data = b"".join(data) if isinstance(data, list) else data
                    for off, piece, last in frame_spans(data, self.frame_bytes):
                        m = pb.PutFrame(version=PROTOCOL_VERSION)
                        fill_frame(m.frame, key, off, len(data), piece, last)
                        yield m

        try:
            with self._rpc("Put", t):
                r = self.stub.Put(frames(), timeout=t)
        finally:
            for name in created:  # taken by the server already, unless the call failed
                shm.unlink_segment(name)
        self._check_version("Put", r.version)
        return PutSummary(r.stored, r.duplicates, list(r.refused_keys), list(r.incomplete_keys))

    # -- Get ------------------------------------------------------------------------------------
    def get(self, keys: list[str], transport: Transport = "inline", timeout_s: float | None = None,
            layout: ChunkLayout | None = None) -> list[KVChunk]:
        """The leading present chunks of keys, in order (stops at the first missing key). With a layout,
        a chunk that does not fit it raises LayoutMismatch (checked before its tensors are built)."""
        return list(self.iter_get(keys, transport, timeout_s, layout))

    def iter_get(self, keys: list[str], transport: Transport = "inline", timeout_s: float | None = None,
                 layout: ChunkLayout | None = None) -> Iterator[KVChunk]:
        """Like get, one chunk at a time. Closing it early cancels the stream (an SHM stream is read
        to its end first, unlinking the segments it names, so none is left behind)."""
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
        if not keys:
            return
        t = timeout_s or self.timeout_s
        call = self.stub.Get(pb.GetRequest(version=PROTOCOL_VERSION, keys=keys, transport=_TRANSPORTS[transport],
                                           frame_bytes=self.frame_bytes), timeout=t)
        asm = Assembler(self.max_chunk_bytes, writable=True)  # this call owns what it assembles: chunks are views of it
        got = 0
        complete = False
        try:
            with self._rpc("Get", t):
                for msg in call:
                    self._check_version("Get", msg.version)
                    if msg.HasField("done"):
                        complete = True
                        if msg.done.found != got:
                            raise BridgeProtocolError("Get", f"server says {msg.done.found} found, sent {got}")
                        return
                    done = self._receive(msg.frame, asm, self.max_chunk_bytes)
                    if done is None:
                        continue
                    key, data = done
                    if got >= len(keys) or key != keys[got]:
                        raise BridgeProtocolError("Get", f"chunk {got} has key {key[:16]}..., not the one asked for")
                    try:  # a buffer only this call holds; LayoutMismatch goes to the caller as is
                        chunk = decode_checked(key, data, self._mac, own=True, layout=layout)
                    except CorruptChunk as e:
                        raise BridgeProtocolError("Get", f"chunk {key[:16]}... failed verification: {e}") from None
                    got += 1
                    yield chunk
            raise BridgeProtocolError("Get", "stream ended without its GetDone message")
        finally:
            if not complete:
                if transport == "shm":
                    _drain_shm(call)
                call.cancel()  # stops the server when the stream is closed early

    @staticmethod
    def _receive(f: pb.ChunkFrame, asm: Assembler, max_bytes: int) -> tuple[str, bytes | bytearray] | None:
        try:
            if f.HasField("shm"):
                if asm.in_flight is not None:
                    raise FrameError("frame.shm", "handle inside an incomplete chunk")
                if not 0 < f.shm.length <= max_bytes:
                    shm.unlink_segment(f.shm.name)
                    raise FrameError("frame.shm.length", f"{f.shm.length} not in 1..{max_bytes}")
                return f.key, shm.take_segment(f.shm.name, f.shm.length, writable=True)
            return asm.feed(f)
        except (FrameError, shm.ShmError) as e:
            raise BridgeProtocolError("Get", str(e)) from None


def _drain_shm(call: Iterator[pb.GetFrame]) -> None:
    """Read the rest of an abandoned SHM stream and unlink every segment it names.

    Cancelling would be faster, but the server may already have sent (and so handed over) the
    remaining handles: only reading them guarantees that no segment outlives the stream. Handle
    messages are tiny; the call's deadline bounds the wait."""
    try:
        for msg in call:
            if msg.HasField("done"):
                return
            if msg.frame.HasField("shm"):
                shm.unlink_segment(msg.frame.shm.name)
    except grpc.RpcError:
        pass  # the stream failed: the server reclaims the segments of an unfinished stream


class RemoteStore:
    """A BridgeClient seen as a ChunkStore (put/get/contains/lookup/stats), e.g. for a prefix cache."""

    def __init__(self, client: BridgeClient, transport: Transport = "inline") -> None:
        self.client = client
        self.transport = transport

    def put(self, chunk: KVChunk) -> bool:
        s = self.client.put([chunk], self.transport)
        return s.stored + s.duplicates == 1

    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        got = self.client.get([key], self.transport, layout=layout)
        return got[0] if got else None

    def get_many(self, keys: list[str], layout: ChunkLayout | None = None) -> list[KVChunk]:
        """The leading present chunks of `keys` that fit `layout`, in ONE streamed call (a prefix
        restore); the run ends before a missing chunk or one that does not fit (get() says which)."""
        out: list[KVChunk] = []
        try:
            for chunk in self.client.iter_get(keys, self.transport, layout=layout):
                out.append(chunk)
        except LayoutMismatch:
            pass
        return out

    def contains(self, key: str) -> bool:
        return self.client.lookup([key]) == 1

    def lookup(self, keys: list[str]) -> int:
        return self.client.lookup(keys)

    def stats(self) -> dict:
        return self.client.stats()

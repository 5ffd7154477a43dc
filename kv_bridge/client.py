"""Client of the KV bridge: every call carries a deadline and the cluster's bearer token, and gRPC
failures become Python exceptions that say which call failed (timeouts are TimeoutErrors, an
unreachable bridge a ConnectionError, a refused token UNAUTHENTICATED). Chunks are sealed with the
cluster's MAC key on the way out; received chunks are verified (MAC, header, lengths, the key asked
for, and the reader's layout when given) before a tensor is built from them.

The byte path: a put or get of several chunks is split across `streams` concurrent gRPC streams,
each on its own channel (its own HTTP/2 connection and flow-control window), each driven by a
thread (gRPC and the copies and hashing below release the GIL). A chunk's bytes are copied once
into each message going out and once out of each message coming in (frame_codec), and hashed
frame by frame on the way (StreamingMac): no pass over a whole chunk besides those.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal, TypeVar

import grpc

from flashpd.kv_bridge import arena, frame_codec, shm, shm_pool
from flashpd.kv_bridge.auth import MAC_BYTES, ClusterSecret, resolve
from flashpd.kv_bridge.chunk import CorruptChunk, KVChunk, LayoutMismatch, Lease, StreamingMac, peek_parent
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2_grpc as pb_grpc
from flashpd.kv_bridge.rpc_guard import with_token
from flashpd.kv_bridge.tls import BridgeTls
from flashpd.kv_bridge.wire import (DEFAULT_FRAME_BYTES, DEFAULT_MAX_CHUNK_BYTES, GRPC_OPTIONS, PROTOCOL_VERSION,
                                    Assembled, Assembler, Buffer, FrameError, clamp_frame_bytes, frame_pieces)

log = logging.getLogger(__name__)

# "arena": as "shm", and a Get reads the entries of a bridge that keeps them in an arena in place (arena.py)
Transport = Literal["inline", "shm", "arena"]
_TRANSPORTS = {"inline": pb.INLINE, "shm": pb.SHM, "arena": pb.SHM}
_SAME_HOST = ("shm", "arena")
DEFAULT_STREAMS = 4  # parallel streams (and connections) of one transfer of several chunks
MAX_STREAMS = 32
# a same-host Put stream's segments written and not yet taken by the bridge, at most (one alone always): its
# handles are a few bytes, so gRPC would otherwise let the writer run a whole prompt's segments ahead into tmpfs
SHM_AHEAD_BYTES = 256 << 20  # (all of one call's streams together)
AHEAD_GRACE_S = 2.0  # the newest segments untaken this long (refused ones stay until the call ends) stop counting
# a publish's deadline (RemoteStore.put_many): the client's timeout, plus its bytes at this floor rate (a bridge
# that hangs fails it about as soon as one chunk's call did; a long prompt still has the time its bytes need)
PUBLISH_FLOOR_BYTES_PER_S = 100e6
_PUT = "/flashpd.kvbridge.v1.KVBridge/Put"
_GET = "/flashpd.kvbridge.v1.KVBridge/Get"
_T = TypeVar("_T")
_PutItem = tuple[str, Callable[[], list[Buffer]], bool, str]  # key, parts, seal, parent ("" if unknown)


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
    """refused counts every refused chunk; refused_keys names them (the server names at most its
    MAX_REFUSED_KEYS a stream)."""
    stored: int = 0
    duplicates: int = 0
    refused_keys: list[str] = field(default_factory=list)
    incomplete_keys: list[str] = field(default_factory=list)
    refused: int = 0

    @property
    def ok(self) -> bool:
        return not self.refused and not self.refused_keys and not self.incomplete_keys


def _map_error(call: str, e: grpc.RpcError, timeout_s: float) -> BridgeError:
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(code)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return BridgeTimeout(call, f"deadline of {timeout_s:g} s exceeded ({details})", code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return BridgeUnavailable(call, f"bridge unavailable: {details}", code)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return BridgeInvalidArgument(call, details, code)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return BridgeUnauthenticated(call, details, code)
    return BridgeError(call, f"{code.name if code else 'error'}: {details}", code)


class BridgeClient:
    """Channels to one bridge. Thread-safe (gRPC channels are); close() when done.

    secret: the cluster's (default: this process's): its token goes with every call (the stub
    included), its MAC key seals and checks chunks. tls: verify the bridge's certificate against
    tls.ca (None: plaintext). max_chunk_bytes: the largest chunk a Get may hand this client.
    streams: how many concurrent streams one put/get of several chunks is split across, each on a
    channel of its own (channels connect on first use: a client that moves one chunk at a time
    opens one connection). pin_device: page-lock the arenas it maps for copies to this CUDA device (a
    reader whose restores go to a GPU; arena.CudaPinner). shm_pool_bytes: tmpfs files allocated ahead for its
    same-host Puts' segments (shm_pool.SegmentPool; 0: none). cooloff_s: after a call that timed out or found the
    bridge unavailable, every call but Health fails at once (BridgeUnavailable) for this long, then one may try again
    (0: never skip). A hung bridge otherwise cost every request a whole timeout, on each side of the handoff, until it
    was restarted; its callers fall back to recomputing, which gives the same tokens."""

    def __init__(self, address: str, timeout_s: float = 30.0, frame_bytes: int = DEFAULT_FRAME_BYTES, *,
                 secret: ClusterSecret | None = None, tls: BridgeTls | None = None,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, streams: int = DEFAULT_STREAMS,
                 pin_device: object = None, shm_pool_bytes: int = shm_pool.DEFAULT_POOL_BYTES,
                 cooloff_s: float = 0.0) -> None:
        if not 1 <= streams <= MAX_STREAMS:
            raise ValueError(f"streams must be in 1..{MAX_STREAMS}, got {streams}")
        self.address = address
        self.timeout_s = timeout_s
        self.frame_bytes = clamp_frame_bytes(frame_bytes)
        self.max_chunk_bytes = max_chunk_bytes
        self.streams = streams
        self.cooloff_s = cooloff_s
        self._down_until = 0.0  # monotonic time before which calls are skipped (cooloff_s)
        self._down_why = ""
        self.skipped_calls = 0
        secret = resolve(secret)
        self._mac = secret.mac_key
        # this client's Put segments carry its owner id; only its Put calls present the key (see shm.SegmentOwner)
        self._shm_owner = shm.SegmentOwner.generate()
        self._shm_md = [self._shm_owner.metadata()]
        self._shm_pool = shm_pool.SegmentPool(shm_pool_bytes)  # its files allocated ahead of the Puts' segments
        # the arenas of this bridge this client has mapped; page-locked for a GPU's copies (pin_device, arena.py)
        self._arenas = arena.ArenaMaps(arena.CudaPinner(pin_device) if pin_device is not None else None)
        # a pool of its own per channel: channels with equal options would otherwise share one connection
        options = GRPC_OPTIONS + [("grpc.use_local_subchannel_pool", 1)]
        self._channels = [grpc.secure_channel(address, tls.channel_credentials(), options=options)
                          if tls is not None else grpc.insecure_channel(address, options=options)
                          for _ in range(streams)]
        authed = self._authed = [with_token(c, secret.token) for c in self._channels]  # close these, not those
        self.stub = pb_grpc.KVBridgeStub(authed[0])
        # the byte path: PutFrames go out as bytes made here, GetFrames are read by frame_codec
        self._put_calls = [c.stream_unary(_PUT, response_deserializer=pb.PutReply.FromString) for c in authed]
        get_frame = frame_codec.safe(frame_codec.decode_get_frame, frame_codec.GET_FRAME)
        self._get_calls = [c.unary_stream(_GET, request_serializer=pb.GetRequest.SerializeToString,
                                          response_deserializer=get_frame) for c in authed]

    def close(self) -> None:
        for c in self._authed:
            c.close()
        self._arenas.close()
        self._shm_pool.close()

    def arena_stats(self) -> dict:
        """The arenas this client has mapped, and how many are page-locked (ArenaMaps.stats)."""
        return self._arenas.stats()

    def shm_pool_stats(self) -> dict:
        """Its Put segment pool: writes into pool files and into fresh ones, files made, bytes held, and why it is
        off (None: on; shm_pool.SegmentPool)."""
        return self._shm_pool.stats_now()

    def __enter__(self) -> "BridgeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _rpc(self, call: str, timeout_s: float) -> Iterator[None]:
        if call != "Health":  # a probe is how anyone learns the bridge is back
            self._check_up(call)
        try:
            yield
        except grpc.RpcError as e:
            err = _map_error(call, e, timeout_s)
            if self.cooloff_s > 0 and isinstance(err, (BridgeTimeout, BridgeUnavailable)):
                self._down_until, self._down_why = time.monotonic() + self.cooloff_s, str(err)
            raise err from None
        if call != "Health":  # a bridge that answers probes can still hang on its store: only data calls clear it
            self._down_until = 0.0

    def _check_up(self, call: str) -> None:
        """Raise BridgeUnavailable at once while the cool-off after a failed call lasts (cooloff_s)."""
        left = self._down_until - time.monotonic()
        if left > 0:
            self.skipped_calls += 1
            raise BridgeUnavailable(call, f"skipped for {left:.1f} s more: a call {self.cooloff_s - left:.1f} s ago "
                                          f"failed ({self._down_why})")

    def _check_version(self, call: str, version: int) -> None:
        if version != PROTOCOL_VERSION:
            raise BridgeProtocolError(call, f"reply version {version}, expected {PROTOCOL_VERSION}")

    # -- unary calls ----------------------------------------------------------------------------
    def lookup(self, keys: list[str], timeout_s: float | None = None) -> int:
        """Number of LEADING keys the bridge holds."""
        if not keys:
            return 0
        return self._lookup("Lookup", keys, timeout_s or self.timeout_s)

    def _lookup(self, call: str, keys: list[str], t: float) -> int:
        """A Lookup whose failures name `call` (the one it is part of)."""
        with self._rpc(call, t):
            r = self.stub.Lookup(pb.LookupRequest(version=PROTOCOL_VERSION, keys=keys), timeout=t)
        self._check_version(call, r.version)
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
        """Stream chunks to the bridge, split across the client's streams (each serialized when its
        stream reaches it; inline, the MAC is computed frame by frame as the bytes go out; over shared
        memory the tensors' bytes go straight into the segment). A chunk whose parent is in the same call
        goes on its parent's stream, in the call's order (see _chains); separate chains reach the store
        in no particular order."""
        if transport in _SAME_HOST:
            items = ((c.key, lambda c=c: c.to_parts(self._mac), False, c.parent) for c in chunks)
        else:
            items = ((c.key, c.body_parts, True, c.parent) for c in chunks)
        return self._put(items, transport, timeout_s)

    def put_bytes(self, items: Iterable[tuple[str, bytes | list[bytes | memoryview]]], transport: Transport = "inline",
                  timeout_s: float | None = None) -> PutSummary:
        """Stream already-serialized chunks (bytes, or a list of their parts in order); the server
        verifies each one and reports refusals."""
        return self._put(((key, lambda d=data: d if isinstance(d, list) else [d], False, _parent_of(data))
                          for key, data in items), transport, timeout_s)

    def _put(self, items: Iterable[_PutItem], transport: Transport, timeout_s: float | None) -> PutSummary:
        """items: (key, parts, seal, parent): parts() gives the chunk's bytes in pieces when its stream
        reaches it (serialized lazily); seal: they are the body, the MAC to be computed on the way and sent
        last; parent: its parent's key, which decides its stream (_chains)."""
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
        t = timeout_s or self.timeout_s
        items = list(items)
        shares = _spread(_chains(items), self.streams)
        ahead = SHM_AHEAD_BYTES // max(1, len(shares))  # the call's streams share SHM_AHEAD_BYTES
        if len(shares) == 1:
            return self._put_stream(shares[0], transport, t, 0, ahead)
        outcomes = _run_all([lambda j=j: self._put_stream(shares[j], transport, t, j, ahead)
                             for j in range(len(shares))])
        for o in outcomes:
            if isinstance(o, BaseException):
                raise o
        order = {}
        for i, (key, *_) in enumerate(items):
            order.setdefault(key, i)
        merged = PutSummary(sum(o.stored for o in outcomes), sum(o.duplicates for o in outcomes),
                            refused=sum(o.refused for o in outcomes))
        rank = lambda k: order.get(k, len(items))  # noqa: E731
        merged.refused_keys = sorted((k for o in outcomes for k in o.refused_keys), key=rank)
        merged.incomplete_keys = sorted((k for o in outcomes for k in o.incomplete_keys), key=rank)
        return merged

    def _put_stream(self, items: list[_PutItem], transport: Transport, t: float, channel: int,
                    ahead_bytes: int = SHM_AHEAD_BYTES) -> PutSummary:
        """One Put stream of items (see _put) on one channel; same-host, at most ahead_bytes of its segments written
        and not yet taken (one alone always).

        gRPC pulls frames() on a thread of its own, which may still be writing a segment when the call has
        already failed (a deadline, the server gone): that segment is unlinked here once written, since the
        cleanup below has run and the server never learns its name."""
        created: list[str] = []
        lock = threading.Lock()
        ended = [False]  # the call has returned: no segment written from now on is sent or cleaned up later
        ahead: list[tuple[str, int]] = []  # this stream's segments not yet seen taken: (name, bytes)

        def frames() -> Iterator[bytes]:
            for key, make_parts, seal, _ in items:
                parts = make_parts()
                if transport in _SAME_HOST:
                    size = sum(len(memoryview(p).cast("B")) for p in parts)
                    if not _wait_taken(ahead, size, lambda: ended[0], ahead_bytes):
                        return
                    # its writer's pid (shm.PutLeftovers) and this client's owner id (shm.SegmentOwner)
                    name = self._shm_pool.write(parts, self._shm_owner.put_tag)
                    with lock:
                        if ended[0]:
                            shm.unlink_segment(name)
                            return
                        created.append(name)
                    ahead.append((name, size))
                    yield pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
                        key=key, offset=0, total_length=size, last=True,
                        shm=pb.ShmHandle(name=name, length=size))).SerializeToString()
                else:
                    yield from self._messages(key, parts, seal)

        try:
            with self._rpc("Put", t):
                r = self._put_calls[channel](frames(), timeout=t,
                                             metadata=self._shm_md if transport in _SAME_HOST else None)
        finally:
            with lock:
                ended[0] = True
                names = list(created)
            for name in names:  # taken by the server already, unless the call failed
                shm.unlink_segment(name)
        self._check_version("Put", r.version)
        return PutSummary(r.stored, r.duplicates, list(r.refused_keys), list(r.incomplete_keys), r.refused)

    def _messages(self, key: str, parts: list[Buffer], seal: bool) -> Iterator[bytes]:
        """The serialized PutFrames of one chunk: each frame's envelope around views of the parts, joined
        once. seal: the parts are the body; each frame is hashed as it is cut and the MAC follows the body."""
        tag = bytearray(MAC_BYTES)
        parts = [*parts, tag] if seal else parts
        total = sum(len(memoryview(p).cast("B")) for p in parts)
        mac = StreamingMac(self._mac, total) if seal else None
        raw_key = key.encode()
        for off, pieces, last in frame_pieces(parts, self.frame_bytes):
            if mac is not None:
                for p in pieces:
                    mac.update(p)
                if mac.body_done:  # the tag's bytes are in this frame or the next: fill them before use
                    tag[:] = mac.digest()
                    mac = None
            n = sum(len(p) for p in pieces)
            head, tail = frame_codec.frame_envelope(PROTOCOL_VERSION, raw_key, off, total, n, last)
            yield b"".join([head, *pieces, tail])

    # -- Get ------------------------------------------------------------------------------------
    def get(self, keys: list[str], transport: Transport = "inline", timeout_s: float | None = None,
            layout: ChunkLayout | None = None) -> list[KVChunk]:
        """The leading present chunks of keys, in order (stops at the first missing key). With a layout,
        a chunk that does not fit it raises LayoutMismatch (checked before its tensors are built). A
        failed stream fails the whole call: no chunk of it is returned."""
        return list(self.iter_get(keys, transport, timeout_s, layout))

    def iter_get(self, keys: list[str], transport: Transport = "inline", timeout_s: float | None = None,
                 layout: ChunkLayout | None = None) -> Iterator[KVChunk]:
        """Like get, one chunk at a time, in order. With several streams, a Lookup first bounds the
        transfer to the leading present keys, which the streams then fetch round-robin (key i on stream
        i mod streams); a key evicted in between ends the run there. Closing it early cancels the
        streams (an SHM stream is read to its end first, unlinking the segments it names, so none is
        left behind)."""
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
        if transport == "arena" and not arena.available():
            raise ValueError("transport 'arena' needs Linux memfd_create and file seals (use 'shm')")
        if not keys:
            return
        self._check_up("Get")  # before its streams are opened
        t = timeout_s or self.timeout_s
        # an arena Get moves no bytes, only handles: one stream (more would add a Lookup and threads contending
        # for the cores that verify each chunk's MAC, itself multi-threaded)
        streams = 1 if transport == "arena" else self.streams
        if streams > 1 and len(keys) > 1:
            keys = keys[:self._lookup("Get", keys, t)]
            if not keys:
                return
        n = min(streams, len(keys))
        calls = [self._get_calls[j](pb.GetRequest(version=PROTOCOL_VERSION, keys=keys[j::n],
                                                  transport=_TRANSPORTS[transport], frame_bytes=self.frame_bytes,
                                                  arena=transport == "arena"),
                                    timeout=t) for j in range(n)]
        if n == 1:
            yield from self._read_get(calls[0], keys, transport, t, layout)
            return
        yield from _in_order(len(keys), [lambda j=j: self._read_get(calls[j], keys[j::n], transport, t, layout)
                                         for j in range(n)],
                             stop=None if transport in _SAME_HOST else lambda: [c.cancel() for c in calls])

    def _read_get(self, call, keys: list[str], transport: Transport, t: float,
                  layout: ChunkLayout | None) -> Iterator[KVChunk]:
        """The chunks of one Get stream, verified, in order. Closing it early cancels the stream (an SHM
        stream is read to its end first, unlinking the segments it names)."""
        asm = Assembler(self.max_chunk_bytes, writable=True, mac=self._mac)  # buffers of this call alone
        got = 0
        complete = False
        try:
            with self._rpc("Get", t):
                for msg in call:
                    if isinstance(msg, frame_codec.Undecodable):
                        raise BridgeProtocolError("Get", f"reply: not a valid {msg.type_name} ({msg.reason})")
                    self._check_version("Get", msg.version)
                    if msg.done is not None:
                        complete = True
                        if msg.done != got:
                            raise BridgeProtocolError("Get", f"server says {msg.done} found, sent {got}")
                        return
                    done = self._receive(msg.frame or frame_codec.Frame(), asm, self.max_chunk_bytes, self._arenas)
                    if done is None:
                        continue
                    if got >= len(keys) or done.key != keys[got]:
                        raise BridgeProtocolError("Get", f"chunk {got} has key {done.key[:16]}..., "
                                                         "not the one asked for")
                    try:  # a buffer only this call holds (or the arena's, read-only); LayoutMismatch goes as is
                        chunk = KVChunk.from_bytes(done.data, self._mac, own=done.lease is None, layout=layout,
                                                   key=done.key, body_mac=done.body_mac, share=done.lease is not None)
                        chunk.lease = done.lease
                    except CorruptChunk as e:
                        if done.lease is None:
                            raise BridgeProtocolError("Get", f"chunk {done.key[:16]}... failed verification: {e}") \
                                from None
                        # read in place in the bridge's arena, which hands entries out unverified: the run ends
                        # before it (recomputed), and the bridge is made to drop it (it would fail every Get)
                        log.warning("arena chunk %s... failed verification (%s); asking the bridge to drop it",
                                    done.key[:16], e)
                        self._drop_corrupt(done.key, t)
                        return
                    got += 1
                    yield chunk
            raise BridgeProtocolError("Get", "stream ended without its GetDone message")
        finally:
            if not complete:
                if transport in _SAME_HOST:
                    _drain_shm(call)
                call.cancel()  # stops the server when the stream is closed early

    def _drop_corrupt(self, key: str, t: float) -> None:
        """Have the bridge verify key's entry and drop it if it is corrupt: an inline Get of it, which the bridge
        verifies before it sends (a disk tier's good copy, where there is one, comes back up in its place). Best
        effort: a failure leaves the entry to fail the next reader the same way."""
        try:
            self.get([key], "inline", timeout_s=t)
        except BridgeError as e:
            log.warning("asking the bridge to drop chunk %s... failed: %s", key[:16], e)

    @staticmethod
    def _receive(f: frame_codec.Frame, asm: Assembler, max_bytes: int, arenas: arena.ArenaMaps) -> Assembled | None:
        try:
            if f.shm is not None:
                if asm.in_flight is not None:
                    raise FrameError("frame.shm", "handle inside an incomplete chunk")
                if f.shm.arena_pid:
                    return _in_arena(f, max_bytes, arenas)
                if not 0 < f.shm.length <= max_bytes:
                    shm.unlink_segment(f.shm.name)
                    raise FrameError("frame.shm.length", f"{f.shm.length} not in 1..{max_bytes}")
                return Assembled(f.key, shm.take_segment(f.shm.name, f.shm.length, writable=True), None)
            return asm.feed(f)
        except (FrameError, shm.ShmError, arena.ArenaError) as e:
            raise BridgeProtocolError("Get", str(e)) from None


def _in_arena(f: frame_codec.Frame, max_bytes: int, arenas: arena.ArenaMaps) -> Assembled:
    """A chunk read in place in the bridge's arena: a read-only view, its own while its Lease holds (the handle's
    hold less a margin from now, and the slot's generation word unchanged); the caller checks that after copying it
    out (KVChunk.fresh)."""
    s, received = f.shm, time.monotonic()
    if f.offset != 0 or not f.last or f.data or f.total_length != s.length:
        raise FrameError("frame.shm", "an arena handle frame has no data, offset 0, last=true, total_length=length")
    if not 0 < s.length <= max_bytes:
        raise FrameError("frame.shm.length", f"{s.length} not in 1..{max_bytes}")
    hold_s = s.hold_ms / 1000
    if hold_s <= arena.READER_MARGIN_S:
        raise FrameError("frame.shm.hold_ms", f"{s.hold_ms} ms leaves no time to read the chunk")
    ref = arena.ArenaRef(s.arena_pid, s.arena_fd, s.arena_inode, s.arena_size)
    view = arenas.view(ref, s.offset, s.length)
    word = arenas.word(ref, s.gen_offset)
    return Assembled(f.key, view, None, Lease(received + hold_s - arena.READER_MARGIN_S, word, s.gen))


def _wait_taken(ahead: list[tuple[str, int]], size: int, ended: Callable[[], bool],
                limit: int | None = None, grace_s: float | None = None) -> bool:
    """Wait until the segments in `ahead` (oldest first) still under their names (the bridge renames or unlinks one
    when it takes it) and one more of `size` bytes fit `limit`; one alone always fits. False: the call ended
    meanwhile. The bridge takes a stream's segments in order, so one still there while a later one is gone was
    refused: it stops counting at once (it stays until the call's cleanup); the oldest of the rest stops counting
    after grace_s (the newest refused). limit, grace_s: SHM_AHEAD_BYTES and AHEAD_GRACE_S by default."""
    limit = SHM_AHEAD_BYTES if limit is None else limit
    grace_s = AHEAD_GRACE_S if grace_s is None else grace_s
    since = time.monotonic()
    while ahead:
        there = [(shm.SHM_DIR / n).exists() for n, _ in ahead]
        last_taken = max((i for i, x in enumerate(there) if not x), default=-1)
        ahead[:] = [e for i, (e, x) in enumerate(zip(ahead, there)) if x and i > last_taken]
        if not ahead or sum(b for _, b in ahead) + size <= limit:
            return True
        if ended():
            return False
        if time.monotonic() - since > grace_s:
            ahead.pop(0)
            since = time.monotonic()
            continue
        time.sleep(0.001)
    return True


def _parent_of(data: bytes | list[bytes | memoryview]) -> str:
    """The parent a serialized chunk's header names ("" when its first part holds no readable header)."""
    if isinstance(data, list):
        data = data[0] if data else b""
    return peek_parent(data) or ""


def _chains(items: list[_PutItem]) -> list[list[_PutItem]]:
    """Items grouped by parent chain (a chunk joins its parent's group when the parent is in the call),
    each group in the call's order, groups in order of their first item.

    A store may refuse a chunk whose parent it does not hold (a full one evicts nothing for an orphan),
    and then every later chunk of the prompt: so a prompt's chunks travel in order on one stream, and
    only different chains are spread across streams."""
    root = {key: key for key, *_ in items}

    def find(k: str) -> str:
        while root[k] != k:
            root[k] = root[root[k]]
            k = root[k]
        return k

    for key, _, _, parent in items:
        if parent in root:
            root[find(key)] = find(parent)
    groups: dict[str, list[_PutItem]] = {}
    for item in items:
        groups.setdefault(find(item[0]), []).append(item)
    return list(groups.values())


def _spread(chains: list[list[_PutItem]], streams: int) -> list[list[_PutItem]]:
    """At most `streams` shares: each chain, longest first, onto the share with the fewest items so far."""
    shares: list[list[_PutItem]] = [[] for _ in range(max(1, min(streams, len(chains))))]
    for chain in sorted(chains, key=len, reverse=True):  # stable: equal chains keep the call's order
        min(shares, key=len).extend(chain)
    return shares


_MISS = object()  # a stream ended before this key: the key is missing


def _in_order(n: int, streams: list[Callable[[], Iterator[_T]]], stop: Callable[[], object] | None) -> Iterator[_T]:
    """Items 0..n-1 of streams read concurrently (stream j yields items j, j+S, j+2S, ... and stops at its
    first missing one), yielded in order up to the first missing item; an error of a stream is raised
    where it happened. On leaving (done, a miss, an error, or closed early) `stop` is called (it
    cancels the streams' calls), every stream still reading is closed after its current item, and
    every thread is joined: nothing runs on, no stream is left open."""
    s = len(streams)
    cond = threading.Condition()
    slots: dict[int, object] = {}
    leaving = threading.Event()

    def read(j: int) -> None:
        at = j
        outcome: object = _MISS
        it = streams[j]()
        try:
            for item in it:
                with cond:
                    slots[at] = item
                    cond.notify_all()
                at += s
                if leaving.is_set():
                    break
        except BaseException as e:  # noqa: BLE001  raised in the caller's thread where the item was due
            outcome = e
        finally:
            try:
                it.close()  # an SHM stream drains here; an inline one cancels
            finally:  # whatever happens, the caller is not left waiting for this stream's next item
                if at < n:
                    with cond:
                        slots[at] = outcome
                        cond.notify_all()

    threads = [threading.Thread(target=read, args=(j,), name=f"kvbridge-get-{j}", daemon=True) for j in range(s)]
    for th in threads:
        th.start()
    try:
        for i in range(n):
            with cond:
                while i not in slots:
                    cond.wait()
                item = slots.pop(i)
            if item is _MISS:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        leaving.set()
        if stop is not None:
            stop()
        for th in threads:
            th.join()


def _run_all(jobs: list[Callable[[], _T]]) -> list[_T | BaseException]:
    """Run each job on a thread of its own; their results (or what they raised), in job order."""
    out: list[_T | BaseException] = [None] * len(jobs)  # type: ignore[list-item]

    def run(j: int) -> None:
        try:
            out[j] = jobs[j]()
        except BaseException as e:  # noqa: BLE001  handed to the caller
            out[j] = e

    threads = [threading.Thread(target=run, args=(j,), name=f"kvbridge-put-{j}", daemon=True) for j in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def _drain_shm(call: Iterator[frame_codec.FrameMessage]) -> None:
    """Read the rest of an abandoned SHM stream and unlink every segment it names.

    Cancelling would be faster, but the server may already have sent (and so handed over) the
    remaining handles: only reading them guarantees that no segment outlives the stream. Handle
    messages are tiny; the call's deadline bounds the wait."""
    try:
        for msg in call:
            if isinstance(msg, frame_codec.Undecodable) or msg.done is not None:
                return
            if msg.frame is not None and msg.frame.shm is not None:
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

    def put_many(self, chunks: list[KVChunk]) -> int:
        """Store several chunks in ONE call, split across the client's streams (a prompt's chunks
        published together); returns how many the bridge now holds of them. Its deadline: the client's timeout plus
        the chunks' bytes at PUBLISH_FLOOR_BYTES_PER_S."""
        t = self.client.timeout_s + sum(c.nbytes() for c in chunks) / PUBLISH_FLOOR_BYTES_PER_S
        s = self.client.put(chunks, self.transport, timeout_s=t)
        return s.stored + s.duplicates

    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        got = self.client.get([key], self.transport, layout=layout)
        return got[0] if got else None

    def get_many(self, keys: list[str], layout: ChunkLayout | None = None) -> list[KVChunk]:
        """The leading present chunks of `keys` that fit `layout`, in ONE streamed call (a prefix
        restore); the run ends before a missing chunk or one that does not fit (get() says which)."""
        return list(self.iter_many(keys, layout))

    def iter_many(self, keys: list[str], layout: ChunkLayout | None = None) -> Iterator[KVChunk]:
        """get_many's chunks one by one, each as soon as it is read and verified (a restore copies it to the GPU
        while the next is read). Closing it early ends the call as iter_get's close does."""
        try:
            yield from self.client.iter_get(keys, self.transport, layout=layout)
        except LayoutMismatch:
            return

    def contains(self, key: str) -> bool:
        return self.client.lookup([key]) == 1

    def lookup(self, keys: list[str]) -> int:
        return self.client.lookup(keys)

    def stats(self) -> dict:
        return self.client.stats()

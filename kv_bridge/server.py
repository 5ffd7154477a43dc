"""The KV bridge's gRPC service over a ChunkStore: `python -m flashpd.kv_bridge.server`.

Every call must carry the cluster's bearer token (UNAUTHENTICATED otherwise, before a byte of
the request is read); request bytes that do not parse get INVALID_ARGUMENT (rpc_guard.py). Put
refuses a chunk larger than the largest valid one on its FIRST frame, before buffering anything (and
one that would take the partial chunks of all streams past their bound: RESOURCE_EXHAUSTED), ends a
stream whose chunk arrives slower than a floor rate (a trickle StallGuard never sees idle), reassembles
the rest (hashing each frame as it arrives) and verifies whole chunks (MAC, header,
lengths, key) before the store takes them: a chunk that fails is refused and counted and the stream
goes on; nothing of a chunk is visible before its last frame arrived and verified. Get streams the
leading present chunks, inline or by same-host shared-memory handle. A Put's handle is taken only when the
segment's name carries the owner id of the key that Put presents (shm.SegmentOwner): one client cannot make the
bridge read and unlink another's segment (refused, counted, never opened); an owned segment the server does not
take is unlinked by it once the client that wrote it is gone (shm.PutLeftovers). A store that raises ends a
Lookup, Get or Stats INTERNAL with an error id (details in the log), and refuses that one chunk of a Put.
invalid_requests counts each client-caused rejection once: a call ended INVALID_ARGUMENT, or a Put's chunk
refused for its bytes or its handle. Put and Get carry chunk bytes
through frame_codec (no copy into or out of protobuf messages); each stream is one RPC on the
thread pool, so a client's parallel streams are served side by side. Bad requests get
INVALID_ARGUMENT with the field named; the server binds loopback unless told otherwise, and serves
TLS when given a cert.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import threading
import time
import urllib.parse
import uuid
import weakref
from concurrent import futures
from typing import Iterator, NoReturn

import grpc

from flashpd.kv_bridge import frame_codec, shm
from flashpd.kv_bridge.auth import ENV_VAR, ClusterSecret, resolve
from flashpd.kv_bridge.chunk import CorruptChunk, KVChunk, verify_bytes
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2_grpc as pb_grpc
from flashpd.kv_bridge.rpc_guard import TokenGate, add_guarded, token_authorizer
from flashpd.kv_bridge.stall_guard import DEFAULT_IDLE_S, StallGuard
from flashpd.kv_bridge.stop_signal import StopSignal
from flashpd.kv_bridge.store import ChunkStore, PutResult
from flashpd.kv_bridge.tls import BridgeTls
from flashpd.kv_bridge.wire import (DEFAULT_MAX_CHUNK_BYTES, MAX_KEYS, MAX_MESSAGE_BYTES, PROTOCOL_VERSION,
                                    Assembler, BudgetExhausted, ByteBudget, FrameError, check_key,
                                    clamp_frame_bytes, frame_pieces)

log = logging.getLogger(__name__)

SHM_SWEEP_AGE_S = 600.0  # at start: any bridge segment this old was never taken by its reader
DEFAULT_SHM_TTL_S = 60.0  # this server's own segments: a reader takes one within milliseconds
MAX_REFUSED_KEYS = 256  # keys a PutReply names (it counts them all)
DEFAULT_SHM_OUTSTANDING_BYTES = 1 << 30  # handed-out segments not yet taken, all Gets together
SHM_ROOM_WAIT_S = 10.0  # how long a Get waits for readers to take segments before RESOURCE_EXHAUSTED
DEFAULT_MIN_PUT_RATE = 1 << 20  # bytes/s a Put's chunk needs after idle_s of grace: a trickle holds a worker
DEFAULT_INFLIGHT_BYTES = 1 << 30  # partial chunks of all Put streams together, outside any store's budget
REFUSAL_HEADER = "x-flashpd-put-refused"  # a Put reply's trailing metadata: why a chunk's handle was refused
NOT_OWNED_LOG_EVERY_S = 10.0  # at most one warning this often for refused segments (a client could send thousands)
PUT_SWEEP_EVERY_S = 1.0  # how often a server unlinks untaken Put segments of clients gone (shm.PutLeftovers)


class _Bytes:
    """Byte-level access to any ChunkStore: put_bytes/get_bytes when it has them (the store verifies with
    its own secret, unless the bridge did with the same one), else decode/encode with the bridge's."""

    def __init__(self, store: ChunkStore, secret: ClusterSecret) -> None:
        self.store = store
        self._mac = secret.mac_key
        self._same_secret = getattr(store, "secret", None) == secret

    def put(self, key: str, data: bytes | memoryview, body_mac: bytes | None = None) -> PutResult:
        """body_mac: the digest the Assembler computed while the chunk arrived. Bytes that verify with
        it go to a store of the same secret as verified (no second pass over them); any others go
        unverified, for the store to refuse and count as it does every corrupt chunk."""
        if hasattr(self.store, "put_bytes"):
            if body_mac is not None and self._same_secret and self._authentic(key, data, body_mac):
                return self.store.put_bytes(key, data, verified=True)
            return self.store.put_bytes(key, data)
        chunk = KVChunk.from_bytes(data, self._mac, key=key, body_mac=body_mac)
        if self.store.contains(key):
            return PutResult.PRESENT
        return PutResult.STORED if self.store.put(chunk) else PutResult.REFUSED

    def _authentic(self, key: str, data: bytes | memoryview, body_mac: bytes) -> bool:
        try:
            verify_bytes(data, self._mac, key=key, body_mac=body_mac)
        except CorruptChunk:
            return False
        return True

    def get(self, key: str) -> bytes | None:
        if hasattr(self.store, "get_bytes"):
            return self.store.get_bytes(key)
        chunk = self.store.get(key)
        return None if chunk is None else chunk.to_bytes(self._mac)


def bridge_secret(store: ChunkStore, secret: ClusterSecret | None) -> ClusterSecret:
    """The bridge's secret: `secret`, else its store's, else the process default. A store holding
    another secret would refuse every chunk the bridge's clients send: refused here, at start."""
    own = getattr(store, "secret", None)
    chosen = secret if secret is not None else own if own is not None else resolve(None)
    if own is not None and own != chosen:
        raise ValueError("the bridge and its store were given different cluster secrets")
    return chosen


class _StreamPace:
    """A stream's bytes against the floor of `rate` bytes/s of the time it waited on its peer (for a Put's next
    message, for a Get's reader to take one), after `grace_s` of such waiting: the handler's own work (a slow
    store) never counts against the client."""

    def __init__(self, rate: float, grace_s: float) -> None:
        self.rate, self.grace_s = rate, grace_s
        self.bytes = 0
        self.waited = 0.0
        self._since: float | None = None

    def waiting(self) -> None:
        self._since = time.monotonic()

    def arrived(self) -> None:
        if self._since is not None:
            self.waited += time.monotonic() - self._since
            self._since = None

    def behind(self) -> float | None:
        """The time waited on the peer when the stream is behind the floor, else None (also with no floor)."""
        if self.rate <= 0:
            return None
        return self.waited if self.waited > self.grace_s + self.bytes / self.rate else None


class KVBridgeServicer(pb_grpc.KVBridgeServicer):
    """max_chunk_bytes: the largest valid chunk (chunk.max_chunk_bytes of the service's layout); a Put
    announcing more is refused on its first frame. A Put's chunk must arrive at min_put_rate bytes/s once
    put_grace_s have passed since its first frame (<= 0: no floor), and so must a Put stream's bytes over its
    whole life (chunks stored or refused alike) and a Get stream's bytes taken by its reader (_StreamPace); the
    partial chunks of all Puts together are bounded by inflight_max_bytes (see serve)."""

    def __init__(self, store: ChunkStore, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 shm_ttl_s: float = DEFAULT_SHM_TTL_S, secret: ClusterSecret | None = None,
                 shm_max_bytes: int = DEFAULT_SHM_OUTSTANDING_BYTES, *, shm_peer_max_bytes: int | None = None,
                 min_put_rate: float = DEFAULT_MIN_PUT_RATE, put_grace_s: float = DEFAULT_IDLE_S,
                 inflight_max_bytes: int = DEFAULT_INFLIGHT_BYTES) -> None:
        self.store = store
        self.secret = bridge_secret(store, secret)
        self.bytes = _Bytes(store, self.secret)
        self.max_chunk_bytes = max_chunk_bytes
        self.shm_ttl_s = shm_ttl_s
        self.shm_out = shm.SegmentLedger(shm_max_bytes, shm_peer_max_bytes)
        self.shm_left = shm.PutLeftovers()  # Put segments named and not taken: unlinked once their writer is gone
        self.min_put_rate = min_put_rate
        self.put_grace_s = put_grace_s
        self.inflight = ByteBudget(inflight_max_bytes)
        self._lock = threading.Lock()
        self._c = dict(lookups=0, puts_streams=0, frames_received=0, chunks_stored=0, chunks_duplicate=0,
                       chunks_refused_corrupt=0, chunks_refused_store=0, chunks_incomplete=0, gets_streams=0,
                       chunks_sent=0, frames_sent=0, shm_segments_sent=0, shm_segments_reclaimed=0, shm_segments_expired=0,
                       invalid_requests=0, unauthenticated_calls=0, calls_stalled=0, shm_gets_refused_full=0,
                       shm_gets_refused_peer=0, shm_gets_refused_waiting=0, puts_too_slow=0, gets_too_slow=0,
                       puts_refused_inflight=0, shm_put_segments_left=0,
                       shm_put_segments_reclaimed=0, shm_segments_of_dead_writers=0, shm_put_segments_not_owned=0,
                       store_errors=0, arena_handles_sent=0)
        self._not_owned_logged = -NOT_OWNED_LOG_EVERY_S  # when a not-owned refusal was last logged (monotonic)

    def authorizer(self):
        """token_authorizer for this bridge's secret, counting the calls it turns away."""
        check = token_authorizer(self.secret.token)

        def ok(metadata) -> bool:
            if check(metadata):
                return True
            self._count("unauthenticated_calls")
            return False

        return ok

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def count_invalid(self) -> None:
        """One client-caused rejection: a call ended INVALID_ARGUMENT (undecodable bytes included), or one chunk
        of a Put refused for what the client sent. Each is counted once, where it is decided."""
        self._count("invalid_requests")

    def _invalid(self, context: grpc.ServicerContext, message: str) -> None:
        self.count_invalid()
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    def _store_failed(self, context: grpc.ServicerContext, what: str) -> NoReturn:
        """A store call raised (called from its except block): logged in full here under an error id, the call
        ended INTERNAL with a short message naming only that id (no paths, no traceback), the server serving on."""
        error_id = uuid.uuid4().hex[:12]
        log.exception("KVBridge.%s: the store failed (error id %s)", what, error_id)
        self._count("store_errors")
        context.abort(grpc.StatusCode.INTERNAL, f"{what}: the bridge's store failed (error id {error_id})")

    def _check_version(self, version: int, context: grpc.ServicerContext, where: str = "version") -> None:
        if version != PROTOCOL_VERSION:
            self._invalid(context, f"{where}: {version} is not supported (this server speaks {PROTOCOL_VERSION})")

    def _check_keys(self, keys, context: grpc.ServicerContext, unique: bool = False) -> None:
        """unique: a Get naming a key twice would hand out its bytes twice (a shared-memory segment each)."""
        if not keys:
            self._invalid(context, "keys: must not be empty")
        if len(keys) > MAX_KEYS:
            self._invalid(context, f"keys: {len(keys)} keys, more than {MAX_KEYS} in one request")
        seen: dict[str, int] = {}
        for i, k in enumerate(keys):
            try:
                check_key(k, f"keys[{i}]")
            except FrameError as e:
                self._invalid(context, str(e))
            if unique and seen.setdefault(k, i) != i:
                self._invalid(context, f"keys[{i}]: repeats keys[{seen[k]}]")

    # -- RPCs -----------------------------------------------------------------------------------
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupReply:
        self._check_version(request.version, context)
        self._check_keys(request.keys, context)
        self._count("lookups")
        try:
            hits = self.store.lookup(list(request.keys))
        except Exception:  # noqa: BLE001  INTERNAL, not UNKNOWN with the exception's text
            self._store_failed(context, "Lookup")
        return pb.LookupReply(version=PROTOCOL_VERSION, hits=hits)

    def Put(self, request_iterator: Iterator[frame_codec.FrameMessage], context: grpc.ServicerContext) -> pb.PutReply:
        self._count("puts_streams")
        # each frame copied once, without the GIL, into a buffer of this stream's own: the store gets a
        # read-only view of it (a store that keeps bytes copies it once more)
        # an arena store lends the slot a chunk will live in: the frames (or a segment) land there, no copy after
        asm = Assembler(self.max_chunk_bytes, writable=True, mac=self.secret.mac_key, budget=self.inflight,
                        alloc=getattr(self.store, "reserve", None))
        # whose segments this stream may hand over: the owner key its metadata presents (shm.SegmentOwner)
        owner = shm.SegmentOwner.from_metadata(context.invocation_metadata())
        try:
            return self._put_frames(request_iterator, asm, context, owner)
        finally:
            asm.release()  # however the stream ended: its partial chunk leaves the in-flight budget

    def _put_frames(self, request_iterator: Iterator[frame_codec.FrameMessage], asm: Assembler,
                    context: grpc.ServicerContext, owner: shm.SegmentOwner | None) -> pb.PutReply:
        reply = pb.PutReply(version=PROTOCOL_VERSION)
        pace = _StreamPace(self.min_put_rate, self.put_grace_s)
        pace.waiting()
        for msg in request_iterator:  # a cancelled client raises here: the in-flight chunk is dropped
            pace.arrived()
            self._check_version(msg.version, context)
            self._count("frames_received")
            self._check_pace(asm, context)
            f = msg.frame if msg.frame is not None else frame_codec.Frame()
            pace.bytes += len(f.data) if f.data is not None else 0  # (a handle's bytes count once taken)
            self._check_stream_pace(pace, "Put", "puts_too_slow", context)
            try:
                if f.shm is not None:
                    self._put_shm(reply, f, asm, context, owner, pace)
                elif (done := asm.feed(f)) is not None:
                    self._store(reply, done.key, done.data, done.body_mac)
            except FrameError as e:
                self._invalid(context, str(e))
            except BudgetExhausted as e:
                self._count("puts_refused_inflight")
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"frame.total_length: {e}; retry later")
            except shm.NotOwned as e:  # another client's segment (or none of this caller's): never opened
                self._not_owned(reply, f.key, str(e), context)
            except shm.ShmError:  # missing or wrong-sized segment: that chunk is refused, the stream goes on
                self._refuse(reply, f.key, "chunks_refused_corrupt", invalid=True)
            pace.waiting()
        if asm.in_flight is not None:
            reply.incomplete_keys.append(asm.in_flight)
            self._count("chunks_incomplete")
        return reply

    def _check_pace(self, asm: Assembler, context: grpc.ServicerContext) -> None:
        """A chunk in flight earns 1/min_put_rate seconds per byte received after its grace: a client that
        keeps sending a byte now and then (never idle long enough for StallGuard) still cannot hold a worker
        and a chunk's buffer for as long as it likes. Counted as a stalled call."""
        if asm.in_flight is None or self.min_put_rate <= 0:
            return
        elapsed = time.monotonic() - asm.started
        if elapsed <= self.put_grace_s + asm.received / self.min_put_rate:
            return
        self._count("calls_stalled")
        self._count("puts_too_slow")
        log.warning("Put: chunk %s... arrived at %.0f bytes/s, less than %.0f; call ended",
                    asm.in_flight[:16], asm.received / elapsed, self.min_put_rate)
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"frame: chunk {asm.in_flight[:16]}... has {asm.received} of {asm.total} bytes after "
                      f"{elapsed:.1f} s; the bridge needs {self.min_put_rate:.0f} bytes/s after {self.put_grace_s:g} s")

    def _check_stream_pace(self, pace: "_StreamPace", what: str, counter: str, context: grpc.ServicerContext) -> None:
        """A stream past its grace whose bytes came (Put) or were taken (Get) slower than min_put_rate: ended,
        counted as stalled. Per chunk alone, a Put of small chunks, each complete (or refused) in time, or a Get
        read a frame now and then (never idle for StallGuard) held a worker thread for as long as it liked."""
        waited = pace.behind()
        if waited is None:
            return
        self._count("calls_stalled")
        self._count(counter)
        log.warning("%s: a stream moved %d bytes in %.0f s of waiting on its client, less than %.0f bytes/s; "
                    "call ended", what, pace.bytes, waited, self.min_put_rate)
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"{what}: {pace.bytes} bytes in {waited:.1f} s of waiting on the client; the bridge needs "
                      f"{self.min_put_rate:.0f} bytes/s after {self.put_grace_s:g} s")

    def _put_shm(self, reply: pb.PutReply, f: frame_codec.Frame, asm: Assembler, context: grpc.ServicerContext,
                 owner: shm.SegmentOwner | None, pace: "_StreamPace") -> None:
        """A handle's chunk taken and stored, its bytes held in the in-flight budget meanwhile as an inline chunk's
        are (a segment read into fresh memory outside it let four 96 MiB Puts past a 16 MiB bound)."""
        self._check_handle(f, asm, context, owner)  # a bad or foreign handle is refused as such, whatever the load
        n = f.shm.length
        if not self.inflight.acquire(n):
            self._noted(f.shm.name)
            raise BudgetExhausted(f"chunk {f.key[:16]}... of {n} bytes: the receiver has {self.inflight.used} bytes "
                                  f"of chunks in flight, its bound is {self.inflight.max_bytes}")
        try:
            key, data = self._take_shm(f)
            pace.bytes += len(data)
            self._store(reply, key, data, None)
        finally:
            self.inflight.release(n)

    def _check_handle(self, f: frame_codec.Frame, asm: Assembler, context: grpc.ServicerContext,
                      owner: shm.SegmentOwner | None) -> None:
        """A Put's handle, checked before its segment is touched: the name must carry the caller's owner id
        (NotOwned otherwise: every client holds the token and can list /dev/shm, so the name alone proves nothing).
        An owned segment refused (whatever the reason) is noted for reclaim_put_segments: its writer may die before
        unlinking it. A segment not owned is never noted, read nor unlinked here."""
        if not _peer_is_local(context.peer()):
            raise FrameError("frame.shm", "shared memory needs a same-host client")
        check_key(f.key, "frame.key")  # before the key may be named in a reply (a refusal names it)
        if shm.handed_out(f.shm.name):  # a server's Get segment: its reader's, never a Put's to take or unlink
            raise shm.ShmError(f"shm segment {f.shm.name} is one a bridge handed out, not this client's")
        if owner is None:
            raise shm.NotOwned(f"frame.shm.name: this Put presents no valid {shm.SHM_OWNER_HEADER}, so no segment "
                               f"is its own to hand over")
        if not owner.owns(f.shm.name):
            raise shm.NotOwned(f"frame.shm.name: not a segment written by this client (its name does not carry the "
                               f"owner id of this Put's {shm.SHM_OWNER_HEADER})")
        try:  # the caller's own segment from here: refused for any reason, it is noted for reclaim
            if asm.in_flight is not None:
                raise FrameError("frame.shm", f"handle sent while chunk {asm.in_flight[:16]}... is incomplete")
            if f.data or f.offset != 0 or not f.last or f.total_length != f.shm.length:
                raise FrameError("frame.shm", "a handle frame has no data, offset 0, last=true, "
                                              "total_length=shm.length")
            if not 0 < f.shm.length <= self.max_chunk_bytes:
                raise FrameError("frame.shm.length", f"{f.shm.length} not in 1..{self.max_chunk_bytes}")
        except BaseException:
            self._noted(f.shm.name)
            raise

    def _noted(self, name: str) -> None:
        """The caller's own segment, refused: unlinked by reclaim_put_segments once its writer is gone."""
        if self.shm_left.note(name):
            self._count("shm_put_segments_left")

    def _take_shm(self, f: frame_codec.Frame) -> tuple[str, bytes]:
        """A checked handle's chunk, its segment taken (read and unlinked); refused, the segment is noted."""
        try:
            reserve = getattr(self.store, "reserve", None)
            into = reserve(f.shm.length) if reserve is not None else None
            return f.key, shm.take_segment(f.shm.name, f.shm.length, into=into)
        except BaseException:
            self._noted(f.shm.name)
            raise

    def _not_owned(self, reply: pb.PutReply, key: str, reason: str, context: grpc.ServicerContext) -> None:
        """A chunk refused because its handle names a segment that is not the caller's: counted (an invalid
        request, and shm_put_segments_not_owned), logged, and its reason in the reply's trailing metadata
        (REFUSAL_HEADER: PutReply has no field for a reason); the rest of the stream goes on."""
        context.set_trailing_metadata(((REFUSAL_HEADER, reason),))
        self._count("shm_put_segments_not_owned")
        now = time.monotonic()
        with self._lock:  # one line per NOT_OWNED_LOG_EVERY_S: a client naming segments not its own cannot flood the log
            quiet = now < self._not_owned_logged + NOT_OWNED_LOG_EVERY_S
            if not quiet:
                self._not_owned_logged = now
        if not quiet:
            log.warning("Put from %s: chunk %s... refused: %s (further such refusals for %g s are only counted: "
                        "shm_put_segments_not_owned)", context.peer(), key[:16], reason, NOT_OWNED_LOG_EVERY_S)
        self._refuse(reply, key, "chunks_refused_corrupt", invalid=True)

    def reclaim_put_segments(self) -> int:
        """Unlink the Put segments not taken whose writers are gone (shm.PutLeftovers says when); how many."""
        n = self.shm_left.reclaim()
        if n:
            self._count("shm_put_segments_reclaimed", n)
        return n

    def _store(self, reply: pb.PutReply, key: str, data: bytes | memoryview, body_mac: bytes | None) -> None:
        if isinstance(data, memoryview):
            data = data.toreadonly()  # nobody writes the buffer after this: a store may keep it as is
        try:
            result = self.bytes.put(key, data, body_mac)
        except CorruptChunk:  # malformed, lying header, wrong key, MAC mismatch
            self._refuse(reply, key, "chunks_refused_corrupt", invalid=True)
            return
        except ValueError:  # e.g. a key the disk tier cannot name a file after
            self._refuse(reply, key, "chunks_refused_store", invalid=True)
            return
        except Exception:  # noqa: BLE001  a store failure refuses this chunk; the stream goes on (never UNKNOWN)
            log.exception("the bridge's store failed to take chunk %s... (error id %s)", key[:16],
                          uuid.uuid4().hex[:12])
            self._count("store_errors")
            self._refuse(reply, key, "chunks_refused_store")
            return
        if result is PutResult.STORED:
            reply.stored += 1
            self._count("chunks_stored")
        elif result is PutResult.PRESENT:
            reply.duplicates += 1
            self._count("chunks_duplicate")
        else:
            self._refuse(reply, key, "chunks_refused_store")

    def _refuse(self, reply: pb.PutReply, key: str, counter: str, invalid: bool = False) -> None:
        """`refused` counts every refusal; the first MAX_REFUSED_KEYS keys are named (a reply stays small
        whatever a client sends). invalid: the client's fault (bad bytes, a bad handle), not the store's
        (full, failed): counted in invalid_requests too."""
        reply.refused += 1
        if len(reply.refused_keys) < MAX_REFUSED_KEYS:
            reply.refused_keys.append(key)
        self._count(counter)
        if invalid:
            self.count_invalid()

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Serialized GetFrames: an inline frame is its envelope around views of the store's bytes,
        joined once (the only copy before gRPC's own)."""
        self._check_version(request.version, context)
        self._check_keys(request.keys, context, unique=True)
        if request.transport not in (pb.INLINE, pb.SHM):
            self._invalid(context, f"transport: unknown value {request.transport}")
        use_shm = request.transport == pb.SHM
        if use_shm and not (shm.available() and _peer_is_local(context.peer())):
            self._invalid(context, "transport: SHM needs a same-host client and /dev/shm")
        self._count("gets_streams")
        if use_shm:  # segments handed out before but never taken (a reader that died): bounded lifetime
            self._sweep_shm()
        frame_bytes = clamp_frame_bytes(request.frame_bytes)
        # where the store keeps its entries in an arena (ArenaStore), a same-host reader that asks reads them there
        get_handle = getattr(self.store, "get_handle", None) if use_shm and request.arena else None
        created: list[str] = []
        finished = False
        call = uuid.uuid4().hex

        def reclaim() -> None:  # segments of a stream that did not finish may never be taken
            if not finished:
                for name in created:
                    shm.unlink_segment(name)
                self._count("shm_segments_reclaimed", len(created))
                created.clear()

        context.add_callback(reclaim)
        pace = _StreamPace(self.min_put_rate, self.put_grace_s)
        try:
            found = 0
            for key in request.keys:
                if not context.is_active():
                    return
                self._check_stream_pace(pace, "Get", "gets_too_slow", context)
                if get_handle is not None:
                    try:
                        h = get_handle(key)
                    except Exception:  # noqa: BLE001  INTERNAL, as any store failure
                        self._store_failed(context, "Get")
                    if h is None:
                        break
                    self._count("arena_handles_sent")
                    pace.waiting()
                    yield pb.GetFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
                        key=key, offset=0, total_length=h.length, last=True, shm=pb.ShmHandle(
                            length=h.length, arena_pid=h.arena.pid, arena_fd=h.arena.fd, arena_inode=h.arena.inode,
                            arena_size=h.arena.size, offset=h.offset, hold_ms=int(h.hold_s * 1000),
                            gen_offset=h.gen_offset, gen=h.gen))).SerializeToString()
                    pace.arrived()
                    found += 1
                    pace.bytes += h.length
                    self._count("chunks_sent")
                    continue
                try:
                    data = self.bytes.get(key)
                except Exception:  # noqa: BLE001  INTERNAL; this stream's segments are reclaimed below
                    self._store_failed(context, "Get")
                if data is None:
                    break
                if use_shm:
                    ticket = self._reserve_shm(len(data), call, context)
                    if ticket is None:
                        return
                    name = None
                    try:
                        name = shm.write_segment(data, shm.GET_TAG)
                    except OSError as e:  # /dev/shm full or gone
                        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"transport: shared memory: {e}")
                    finally:
                        self.shm_out.bind(ticket, name)
                    created.append(name)
                    self._count("shm_segments_sent")
                    pace.waiting()
                    yield pb.GetFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
                        key=key, offset=0, total_length=len(data), last=True,
                        shm=pb.ShmHandle(name=name, length=len(data)))).SerializeToString()
                    pace.arrived()
                    pace.bytes += len(data)
                else:
                    raw_key = key.encode()
                    for off, pieces, last in frame_pieces([data], frame_bytes):
                        n = sum(len(p) for p in pieces)
                        head, tail = frame_codec.frame_envelope(PROTOCOL_VERSION, raw_key, off, len(data), n, last)
                        self._count("frames_sent")
                        pace.waiting()
                        yield b"".join([head, *pieces, tail])  # returns once gRPC has sent it
                        pace.arrived()
                        pace.bytes += n
                        self._check_stream_pace(pace, "Get", "gets_too_slow", context)
                found += 1
                self._count("chunks_sent")
            yield pb.GetFrame(version=PROTOCOL_VERSION, done=pb.GetDone(found=found)).SerializeToString()
            # Reached once gRPC took the last message: the client owns the segments now (BridgeClient
            # takes or unlinks every handle it receives; the TTL sweep covers a reader that died).
            finished = True
        finally:
            reclaim()
            self.shm_out.finish(call)

    def _sweep_shm(self) -> None:
        self._count("shm_segments_expired", shm.sweep_segments(self.shm_ttl_s, os.getpid(), shm.GET_TAG))

    def _reserve_shm(self, n: int, call: str, context: grpc.ServicerContext) -> str | None:
        """A ledger ticket for a segment of n bytes; None: the call has ended. Aborts RESOURCE_EXHAUSTED,
        saying why, when there is no room: at once when this peer's own untaken segments fill its share."""
        try:
            ticket = self.shm_out.reserve(n, SHM_ROOM_WAIT_S, context.is_active, peer=context.peer(), call=call,
                                          sweep=self._sweep_shm)
        except shm.NoRoom as e:
            self._count("shm_gets_refused_waiting" if isinstance(e, shm.TooManyWaiting) else "shm_gets_refused_peer")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"transport: {e}")
        if ticket is None and context.is_active():
            self._count("shm_gets_refused_full")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"transport: {self.shm_out.max_bytes} bytes of shared-memory segments are "
                          f"out and not taken; use INLINE or read the handles")
        return ticket

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        self._check_version(request.version, context)
        with self._lock:
            own = dict(self._c)
        counters = {f"server.{k}": v for k, v in own.items()}
        counters["server.shm_segments_expired"] += self.shm_out.expired  # the TTL sweep's and a waiting Get's
        counters["server.shm_outstanding_bytes"] = self.shm_out.outstanding()
        counters["server.inflight_bytes"] = self.inflight.used
        try:
            store_stats = self.store.stats()
        except Exception:  # noqa: BLE001  INTERNAL, not UNKNOWN with the exception's text
            self._store_failed(context, "Stats")
        counters.update(flatten(store_stats, "store"))
        return pb.StatsReply(version=PROTOCOL_VERSION, counters=counters, store=type(self.store).__name__)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        self._check_version(request.version, context)
        return pb.HealthReply(version=PROTOCOL_VERSION, serving=True, store=type(self.store).__name__)


def bulk_handler(servicer: KVBridgeServicer) -> grpc.GenericRpcHandler:
    """Put and Get with frame_codec's messages (the byte path), with the guard add_guarded gives the
    other methods: a request that does not decode gets INVALID_ARGUMENT. serve() adds it before
    add_guarded's handler, which therefore answers only Lookup, Stats and Health (the token is TokenGate's,
    for every method)."""
    service = pb.DESCRIPTOR.services_by_name["KVBridge"]

    def reject(msg: object, context: grpc.ServicerContext) -> None:
        if isinstance(msg, frame_codec.Undecodable):
            servicer.count_invalid()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request: not a valid {msg.type_name} message ({msg.reason})")

    def checked(it, context):
        for msg in it:
            reject(msg, context)
            yield msg

    def put(it, context):
        return servicer.Put(checked(it, context), context)

    def get(request, context):
        reject(request, context)
        yield from servicer.Get(request, context)

    def parse_get_request(data: bytes):
        try:
            return pb.GetRequest.FromString(data)
        except Exception as e:  # noqa: BLE001  whatever the runtime raises for bytes that do not parse
            return frame_codec.Undecodable(pb.GetRequest.DESCRIPTOR.full_name, e)

    handlers = {
        "Put": grpc.stream_unary_rpc_method_handler(
            put, request_deserializer=frame_codec.safe(frame_codec.decode_put_frame, frame_codec.PUT_FRAME),
            response_serializer=pb.PutReply.SerializeToString),
        "Get": grpc.unary_stream_rpc_method_handler(  # the servicer yields serialized GetFrames
            get, request_deserializer=parse_get_request),
    }
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def flatten(d: dict, prefix: str) -> dict[str, int]:
    """Nested int counters as dotted names (non-integers are left out)."""
    out: dict[str, int] = {}
    for k, v in d.items():
        name = f"{prefix}.{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name))
        elif isinstance(v, (int, bool)):
            out[name] = int(v)
    return out


def _peer_is_local(peer: str) -> bool:
    """Whether a gRPC peer ('ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000', 'unix:/path') is on this host: a loopback
    address, or one of this host's own. With allow_remote the workers dial the bridge at its node's address (Ray
    advertises node IPs), so a same-host worker arrives from that address, not from loopback; shm and arena were
    refused to it on every call, and each request recomputed its prompt (its publish failed). A peer that only
    shares the network (another container, its own /dev/shm) still passes here; its handles then fail the
    segment's checks (owner, size, MAC) and are refused, never used."""
    peer = urllib.parse.unquote(peer)
    if peer.startswith("unix:"):
        return True
    host = peer.split(":", 1)[-1].rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])  # a link-local peer's zone: own_addresses drops them too
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:  # a dual-stack socket's IPv4 peer
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip in own_addresses()


_OWN_TTL_S = 30.0  # interfaces come and go (DHCP, a VPN): their addresses are read again after this
_own: tuple[float, frozenset] = (float("-inf"), frozenset())
_own_lock = threading.Lock()


def own_addresses() -> frozenset:
    """This host's interface addresses (psutil), read at most every _OWN_TTL_S; IPv6 zones dropped."""
    global _own
    with _own_lock:
        if time.monotonic() - _own[0] > _OWN_TTL_S:
            import psutil  # noqa: PLC0415  (a dependency; read only where a non-loopback peer asks for shm)

            found = set()
            for addrs in psutil.net_if_addrs().values():
                for a in addrs:
                    try:
                        found.add(ipaddress.ip_address(a.address.split("%", 1)[0]))
                    except ValueError:  # a MAC address (AF_PACKET) and the like
                        pass
            _own = (time.monotonic(), frozenset(found))
        return _own[1]


def is_loopback(host: str) -> bool:
    """Whether a bind address stays on this machine (the services have no authentication)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve(store: ChunkStore, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16,
          max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, allow_remote: bool = False,
          shm_ttl_s: float = DEFAULT_SHM_TTL_S, *, secret: ClusterSecret | None = None,
          tls: BridgeTls | None = None, idle_s: float = DEFAULT_IDLE_S,
          shm_max_bytes: int = DEFAULT_SHM_OUTSTANDING_BYTES, shm_peer_max_bytes: int | None = None,
          min_put_rate: float = DEFAULT_MIN_PUT_RATE,
          inflight_max_bytes: int = DEFAULT_INFLIGHT_BYTES) -> tuple[grpc.Server, int]:
    """Start the bridge on host:port (0 picks a free port); returns the started server and its port.

    max_workers bounds concurrent RPCs (each Put/Get stream holds a worker for its duration).
    max_chunk_bytes: the largest chunk accepted (also bounds a request message to it plus 1 MiB).
    Only loopback hosts are accepted unless allow_remote; beyond loopback, give `tls` (cert and key).
    secret: whose token callers must present (default: the store's, else this process's).
    shm_ttl_s: a shared-memory segment this server handed out and nobody took is unlinked after it.
    idle_s: a call whose client sends or takes nothing for this long is cancelled (stall_guard.py).
    shm_max_bytes: shared-memory segments handed out and not yet taken, all Gets together (one segment
    is always admitted, whatever its size); shm_peer_max_bytes: of one client connection (default a
    quarter of shm_max_bytes), so that one reader who never takes its segments cannot starve the others.
    min_put_rate: bytes/s a Put's chunk must arrive at once idle_s have passed since its first frame
    (<= 0: no floor); a slower stream ends DEADLINE_EXCEEDED and counts as stalled.
    inflight_max_bytes: partial chunks of all Put streams together (one chunk alone always fits); a chunk
    past it is refused RESOURCE_EXHAUSTED on its first frame, before its buffer is allocated."""
    if not (allow_remote or is_loopback(host)):
        raise ValueError(f"host {host!r} is not loopback; pass allow_remote=True to expose the bridge")
    creds = tls.server_credentials() if tls is not None else None  # bad TLS files: refused before anything starts
    if not is_loopback(host) and tls is None:
        log.warning("the KV bridge serves %s without TLS: chunks and the bearer token cross the network in the "
                    "clear (chunk MACs still refuse forged chunks)", host)
    servicer = KVBridgeServicer(store, max_chunk_bytes, shm_ttl_s, secret, shm_max_bytes,
                                shm_peer_max_bytes=shm_peer_max_bytes, min_put_rate=min_put_rate, put_grace_s=idle_s,
                                inflight_max_bytes=inflight_max_bytes)
    shm.sweep_segments(SHM_SWEEP_AGE_S)
    shm.sweep_retired()
    servicer._count("shm_segments_of_dead_writers", shm.sweep_dead_writers())
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", min(MAX_MESSAGE_BYTES, max_chunk_bytes + (1 << 20)))]
    guards = [TokenGate(servicer.authorizer()),  # first: a stranger's call is refused before anything else
              StallGuard(idle_s, on_cancel=lambda method: servicer._count("calls_stalled"))]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvbridge"),
                         options=options, maximum_concurrent_rpcs=max_workers * 4, interceptors=guards)
    server.add_generic_rpc_handlers((bulk_handler(servicer),))  # first: it serves Put and Get
    add_guarded(server, servicer, pb.DESCRIPTOR.services_by_name["KVBridge"], on_invalid=servicer.count_invalid)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    server.start()
    threading.Thread(target=_reclaim_put_segments, args=(weakref.ref(server), servicer), name="bridge-put-reclaim",
                     daemon=True).start()
    return server, bound


def _reclaim_put_segments(server_ref: weakref.ref, servicer: KVBridgeServicer) -> None:
    """Every PUT_SWEEP_EVERY_S until the server stops (or is gone): the Put segments it did not take of clients
    that died go (KVBridgeServicer.reclaim_put_segments), its own Get segments past their TTL, and retired segments left by processes that died
    (shm.sweep_retired), not only at the next start's sweep."""
    while (server := server_ref()) is not None and server.wait_for_termination(PUT_SWEEP_EVERY_S):  # True: timed out
        del server  # not held between rounds: a server nobody holds is not kept alive by this thread
        try:
            servicer.reclaim_put_segments()
            servicer._sweep_shm()  # Get segments past shm_ttl_s (a reader killed mid-Get): not only at the next Get
        except Exception:  # noqa: BLE001  a failed round is logged; the next one tries again
            log.exception("reclaiming Put segments failed")
        try:
            shm.sweep_retired()  # taken segments a process renamed and died before unlinking (shm.retire)
            # what no one can take any more: a dead bridge's Get segments, a client's written ahead of a Put it
            # died in (PutLeftovers knows only those a Put named)
            servicer._count("shm_segments_of_dead_writers", shm.sweep_dead_writers())
        except Exception:  # noqa: BLE001
            log.exception("sweeping retired segments failed")


def main(argv: list[str] | None = None) -> int:
    """Run a bridge with a memory (and optionally disk) tier until SIGINT/SIGTERM; prints 'PORT n'.
    Its clients need its secret: set FLASHPD_CLUSTER_SECRET (64 hex digits) for both."""
    from flashpd.kv_bridge.disk import DiskStore, TieredStore
    from flashpd.kv_bridge.store import MemoryStore

    ap = argparse.ArgumentParser(description="flashpd KV bridge server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--memory-bytes", type=int, default=4 << 30)
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument("--disk-bytes", type=int, default=64 << 30)
    ap.add_argument("--max-workers", type=int, default=16)
    ap.add_argument("--max-chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES)
    ap.add_argument("--idle-s", type=float, default=DEFAULT_IDLE_S,
                    help="cancel a call whose client sends or takes nothing for this long")
    ap.add_argument("--min-put-rate", type=float, default=DEFAULT_MIN_PUT_RATE,
                    help="bytes/s a Put's chunk must arrive at once --idle-s have passed (0: no floor)")
    ap.add_argument("--inflight-bytes", type=int, default=DEFAULT_INFLIGHT_BYTES,
                    help="bound on the partial chunks of all Put streams together")
    ap.add_argument("--tls-cert", default=None)
    ap.add_argument("--tls-key", default=None)
    ap.add_argument("--arena", action="store_true",
                    help="keep the memory tier in a shared-memory arena that same-host readers map "
                         "(kv_bridge/arena.py)")
    ap.add_argument("--no-arena-populate", action="store_true",
                    help="do not fault the arena's pages in at start (they then fault as puts first write them)")
    args = ap.parse_args(argv)
    secret = ClusterSecret.from_env()
    if secret is None:  # a random secret of its own would admit no client at all
        ap.error(f"set {ENV_VAR} (64 hex digits, e.g. from secrets.token_hex(32)) here and for its clients")
    if args.arena:
        from flashpd.kv_bridge.arena_store import ArenaStore

        store: ChunkStore = ArenaStore(args.memory_bytes, secret, populate=not args.no_arena_populate)
    else:
        store = MemoryStore(args.memory_bytes, secret)
    if args.disk_dir:
        store = TieredStore(store, DiskStore(args.disk_dir, args.disk_bytes, secret))
    server, port = serve(store, args.host, args.port, args.max_workers, args.max_chunk_bytes, secret=secret,
                         tls=BridgeTls.from_paths(args.tls_cert, args.tls_key, None), idle_s=args.idle_s,
                         min_put_rate=args.min_put_rate, inflight_max_bytes=args.inflight_bytes)
    stop = StopSignal()  # before PORT: a launcher may stop it the moment it reads that (the disk flush below runs)
    print(f"PORT {port}", flush=True)
    stop.wait()
    server.stop(grace=2).wait(5)
    if isinstance(store, TieredStore):
        store.close()  # the disk tier's queued writes, within a bound (disk.CLOSE_FLUSH_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())

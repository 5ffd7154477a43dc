"""What one client can take from a bridge that others need (real gRPC servers on 127.0.0.1, real files in
/dev/shm): worker threads, reply sizes, host memory, the server process itself.

- a call without the token is refused before its request is read, so stalled strangers hold no worker;
- a call whose client stalls (request never sent, stream stopped mid-chunk, responses never read) is
  cancelled after idle_s, and the server goes on serving;
- keys are bounded in length and number, a Get may not name a key twice, a PutReply names at most
  MAX_REFUSED_KEYS keys (and counts them all);
- a shared-memory handle must name a regular file (a FIFO or a link is refused, never opened blocking);
- shared-memory segments handed out and not taken are bounded in bytes: past the bound a Get waits, then
  gets RESOURCE_EXHAUSTED, and its segments are reclaimed.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid

import grpc
import pytest
import torch

from flashpd.cluster.generation_server import new_server
from flashpd.cluster.proto_gen import generation_pb2 as gpb
from flashpd.cluster.proto_gen import generation_pb2_grpc as gpb_grpc
from flashpd.kv_bridge import server as server_mod
from flashpd.kv_bridge import shm
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.chunk import KVChunk
from flashpd.kv_bridge.client import BridgeError
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2_grpc as pb_grpc
from flashpd.kv_bridge.server import MAX_REFUSED_KEYS
from flashpd.kv_bridge.store import MemoryStore
from flashpd.kv_bridge.wire import MAX_KEY_CHARS, MAX_KEYS, PROTOCOL_VERSION, split_frames

from tests._kv_bridge_helpers import BridgeHarness

TIMEOUT_S = 10.0
IDLE_S = 0.5
WORKERS = 2

needs_shm = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm on this machine")


class Bridge(BridgeHarness):
    def __init__(self, **kw) -> None:
        super().__init__(timeout_s=TIMEOUT_S, max_workers=WORKERS, idle_s=IDLE_S, **kw)

    def healthy_within(self, seconds: float) -> bool:
        try:
            return self.client.health(timeout_s=seconds)["serving"]
        except Exception:  # noqa: BLE001  a timeout is the failure this measures
            return False

    def counters(self) -> dict:
        return self.client.stats()


@pytest.fixture
def bridge():
    b = Bridge()
    yield b
    b.stop()


def chunk_bytes(b: Bridge, key: str, n_tokens: int = 4, width: int = 2,
                secret: ClusterSecret | None = None) -> bytes:
    return KVChunk(key, "", "fp", list(range(n_tokens)), torch.zeros(1, 2, n_tokens, 1, width), None
                   ).to_bytes((secret or b.secret).mac_key)


def frames(key: str, data: bytes, frame_bytes: int = 4096) -> list[pb.PutFrame]:
    return [pb.PutFrame(version=PROTOCOL_VERSION, frame=f) for f in split_frames(key, data, frame_bytes)]


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def never_sends(release: threading.Event, first: list | None = None):
    """A request stream that sends `first` (if any) and then nothing until released."""
    yield from first or []
    release.wait()


# ---- worker threads --------------------------------------------------------------------------------

def test_strangers_that_never_send_their_request_hold_no_worker(bridge):
    release = threading.Event()
    health = bridge.channel.stream_unary("/flashpd.kvbridge.v1.KVBridge/Health")  # a unary method, fed lazily
    calls = [health.future(never_sends(release), timeout=30) for _ in range(4 * WORKERS)]
    try:
        for c in calls:  # refused at once, with nothing sent
            with pytest.raises(grpc.RpcError) as e:
                c.result(timeout=TIMEOUT_S)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert bridge.healthy_within(3.0)
    finally:
        release.set()
    assert bridge.counters()["server.unauthenticated_calls"] == 4 * WORKERS


@pytest.mark.parametrize("stall", ["unary-request", "put-mid-chunk", "get-unread"])
def test_a_client_that_stalls_is_cancelled_and_the_bridge_goes_on(bridge, stall):
    data = chunk_bytes(bridge, "big", n_tokens=256, width=2048)  # 4 MiB: past any flow-control window
    assert bridge.client.put_bytes([("big", data)]).stored == 1
    release = threading.Event()
    if stall == "unary-request":
        call = bridge.channel.stream_unary("/flashpd.kvbridge.v1.KVBridge/Lookup")
        futs = [call.future(never_sends(release), timeout=30, metadata=bridge.md()) for _ in range(WORKERS)]
    elif stall == "put-mid-chunk":
        first = frames("other", chunk_bytes(bridge, "other", n_tokens=256, width=64))[:1]
        futs = [bridge.raw.Put.future(never_sends(release, first), timeout=30, metadata=bridge.md())
                for _ in range(WORKERS)]
    else:
        req = pb.GetRequest(version=PROTOCOL_VERSION, keys=["big"], frame_bytes=64 << 10)
        slow = grpc.insecure_channel(bridge.address, options=[("grpc.http2.bdp_probe", 0)])  # a 64 KiB window
        streams = [pb_grpc.KVBridgeStub(slow).Get(req, timeout=30, metadata=bridge.md()) for _ in range(WORKERS)]
        for s in streams:
            next(s)  # the call is under way; the rest is never read
        futs = streams
    try:
        time.sleep(0.2)
        assert not bridge.healthy_within(0.2)  # every worker is held: the stall is real
        time.sleep(2 * IDLE_S + 1.0)  # the watchdog's period is IDLE_S / 4
        for f in futs:
            with pytest.raises(grpc.RpcError) as e:
                f.result(timeout=TIMEOUT_S) if stall != "get-unread" else list(f)
            assert e.value.code() == grpc.StatusCode.CANCELLED
        assert bridge.healthy_within(3.0)
    finally:
        release.set()
        if stall == "get-unread":
            slow.close()
    c = bridge.counters()
    assert c["server.calls_stalled"] == WORKERS
    assert c["store.entries"] == 1  # the stopped Put stored nothing
    assert bridge.client.get(["big"])[0].key == "big"


def test_a_slow_handler_is_not_a_stall(bridge, monkeypatch):
    """Time a handler spends on its own work (here a slow store) never counts against its client."""
    data = chunk_bytes(bridge, "k")
    assert bridge.client.put_bytes([("k", data)]).stored == 1
    slow = bridge.store.get_bytes

    def get_bytes(key):
        time.sleep(3 * IDLE_S)
        return slow(key)

    monkeypatch.setattr(bridge.store, "get_bytes", get_bytes)
    assert bridge.client.get(["k"])[0].key == "k"
    assert bridge.counters()["server.calls_stalled"] == 0


def test_the_generation_service_cancels_a_stalled_call_too():
    class Idle(gpb_grpc.PrefillWorkerServicer):
        def Health(self, request, context):
            return gpb.HealthReply(version=1, serving=True)

    server, port = new_server("127.0.0.1", 0, False, WORKERS, {"PrefillWorker": Idle()}, idle_s=IDLE_S)
    release = threading.Event()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.stream_unary("/flashpd.generation.v1.PrefillWorker/Health")
            futs = [call.future(never_sends(release), timeout=30) for _ in range(WORKERS)]
            for f in futs:
                with pytest.raises(grpc.RpcError) as e:
                    f.result(timeout=TIMEOUT_S)
                assert e.value.code() == grpc.StatusCode.CANCELLED
            stub = gpb_grpc.PrefillWorkerStub(ch)
            # the cancelled calls leave the server's RPC limit as their handlers unwind (RESOURCE_EXHAUSTED until
            # then, under load): served again within seconds
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    assert stub.Health(gpb.HealthRequest(version=1), timeout=3.0).serving
                    break
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
    finally:
        release.set()
        server.stop(grace=None).wait(TIMEOUT_S)


# ---- keys and replies --------------------------------------------------------------------------------

def test_keys_are_bounded_in_length_and_number_and_a_get_names_each_once(bridge):
    long_key = "k" * (MAX_KEY_CHARS + 1)
    ok_key = "k" * MAX_KEY_CHARS
    data = chunk_bytes(bridge, ok_key)
    assert bridge.client.put_bytes([(ok_key, data)]).stored == 1  # the longest key is served
    assert code_of(lambda: bridge.raw.Put(iter(frames(long_key, data)), timeout=TIMEOUT_S, metadata=bridge.md())) \
        == grpc.StatusCode.INVALID_ARGUMENT
    for keys in ([long_key], [ok_key] * (MAX_KEYS + 1)):
        assert code_of(lambda: bridge.raw.Lookup(pb.LookupRequest(version=PROTOCOL_VERSION, keys=keys),
                                                 timeout=TIMEOUT_S, metadata=bridge.md())) \
            == grpc.StatusCode.INVALID_ARGUMENT
    get = lambda keys: list(bridge.raw.Get(pb.GetRequest(version=PROTOCOL_VERSION, keys=keys),  # noqa: E731
                                           timeout=TIMEOUT_S, metadata=bridge.md()))
    assert code_of(lambda: get([ok_key, "x", ok_key])) == grpc.StatusCode.INVALID_ARGUMENT
    assert len(get([ok_key, "x"])) == 2  # one chunk frame, then done: distinct keys are served
    assert bridge.counters()["server.invalid_requests"] == 4  # the Put, two Lookups, the Get


def test_a_put_reply_names_a_bounded_number_of_refused_keys_and_counts_them_all(bridge):
    n = MAX_REFUSED_KEYS + 40
    bad = [f for i in range(n) for f in frames(f"bad{i}", b"not a chunk")]
    good = frames("good", chunk_bytes(bridge, "good"))
    reply = bridge.raw.Put(iter(bad + good), timeout=TIMEOUT_S, metadata=bridge.md())
    assert (reply.stored, reply.refused, len(reply.refused_keys)) == (1, n, MAX_REFUSED_KEYS)
    assert list(reply.refused_keys) == [f"bad{i}" for i in range(MAX_REFUSED_KEYS)]
    assert bridge.counters()["server.chunks_refused_corrupt"] == n


# ---- shared memory ---------------------------------------------------------------------------------------

OWNER = shm.SegmentOwner.generate()  # this test process's Put segments (as a BridgeClient's)


def shm_handle_put(b: Bridge, name: str, length: int) -> pb.PutReply:
    frame = pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
        key="s", offset=0, total_length=length, last=True, shm=pb.ShmHandle(name=name, length=length)))
    return b.raw.Put(iter([frame]), timeout=TIMEOUT_S, metadata=b.md(owner=OWNER))


@needs_shm
def test_a_handle_naming_a_fifo_or_a_link_is_refused_without_blocking(bridge, tmp_path):
    data = chunk_bytes(bridge, "s")
    fifo = f"fpkv-{os.getpid()}-{OWNER.put_tag}{uuid.uuid4().hex}"  # names this caller owns: the file is checked
    link = f"fpkv-{os.getpid()}-{OWNER.put_tag}{uuid.uuid4().hex}"
    target = tmp_path / "target"
    target.write_bytes(data)
    os.mkfifo(shm.SHM_DIR / fifo)
    os.symlink(target, shm.SHM_DIR / link)
    try:
        for name in (fifo, link):
            t0 = time.monotonic()
            reply = shm_handle_put(bridge, name, len(data))
            assert (reply.stored, list(reply.refused_keys)) == (0, ["s"]), name
            assert time.monotonic() - t0 < 5.0
            assert os.path.lexists(shm.SHM_DIR / name)  # a handle that fails a check is never unlinked
        assert target.read_bytes() == data  # a link's target is never touched
        name = shm.write_segment(data, OWNER.put_tag)  # a real segment is taken
        assert shm_handle_put(bridge, name, len(data)).stored == 1
    finally:
        for name in (fifo, link):
            if os.path.lexists(shm.SHM_DIR / name):
                os.unlink(shm.SHM_DIR / name)


@needs_shm
def test_segment_reads_refuse_a_short_file(tmp_path):
    name = shm.write_segment(b"x" * 100)
    with pytest.raises(shm.ShmError, match="holds 100 bytes"):
        shm.take_segment(name, 200)
    assert os.path.exists(shm.SHM_DIR / name)  # the handle lied, not the segment: left to its owner
    shm.unlink_segment(name)
    for writable in (False, True):
        name = shm.write_segment(b"y" * 100)
        got = shm.take_segment(name, 100, writable=writable)
        assert bytes(got) == b"y" * 100 and isinstance(got, memoryview if writable else bytes)
        assert not writable or not got.readonly  # the caller's own buffer (an importer's tensors alias it)


@needs_shm
def test_untaken_segments_are_bounded_and_a_get_past_the_bound_is_refused(monkeypatch):
    keys = [f"c{i}" for i in range(6)]
    size = len(chunk_bytes(Bridge.__new__(Bridge), keys[0], n_tokens=64, width=256, secret=ClusterSecret.generate()))
    bound = 2 * size + size // 2  # room for two untaken segments, all of them this one client's
    b = Bridge(shm_max_bytes=bound, shm_peer_max_bytes=bound)
    try:
        data = {k: chunk_bytes(b, k, n_tokens=64, width=256) for k in keys}  # 128 KiB each
        assert {len(v) for v in data.values()} == {size}
        assert b.client.put_bytes(list(data.items())).stored == len(keys)
        monkeypatch.setattr(server_mod, "SHM_ROOM_WAIT_S", 0.3)
        before = set(shm.list_segments())
        req = pb.GetRequest(version=PROTOCOL_VERSION, keys=keys, transport=pb.SHM)
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for msg in b.raw.Get(req, timeout=TIMEOUT_S, metadata=b.md()):
                got.append(msg)  # handles arrive; nobody takes their segments
                assert len(set(shm.list_segments()) - before) <= 2
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and len(got) == 2
        deadline = time.monotonic() + TIMEOUT_S
        while set(shm.list_segments()) - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not set(shm.list_segments()) - before  # the failed stream's segments were reclaimed
        c = b.counters()
        assert c["server.shm_gets_refused_full"] == 1 and c["server.shm_outstanding_bytes"] == 0
        # a reader that takes its handles as they come is served whatever the bound
        assert [ch.key for ch in b.client.get(keys, transport="shm")] == keys
    finally:
        b.stop()


# ---- store failures ----------------------------------------------------------------------------------------

SECRET_PATH = "/srv/flashpd/private/tier-7"  # what a store's exception may say, and a client must never see


class FailingStore(MemoryStore):
    """A memory store whose calls raise for the key "boom" (and whose stats raise while fail_stats is set): an
    unexpected store failure, with internal details in its message."""

    fail_stats = False

    def _fail(self) -> None:
        raise OSError(5, "Input/output error", SECRET_PATH)

    def lookup(self, keys: list[str]) -> int:
        if "boom" in keys:
            self._fail()
        return super().lookup(keys)

    def get_bytes(self, key: str) -> bytes | None:
        if key == "boom":
            self._fail()
        return super().get_bytes(key)

    def put_bytes(self, key: str, data, verified: bool = False):
        if key == "boom":
            self._fail()
        return super().put_bytes(key, data, verified)

    def stats(self) -> dict:
        if self.fail_stats:
            self._fail()
        return super().stats()


def test_a_store_failure_is_internal_with_an_error_id_and_the_server_serves_on(caplog):
    """Lookup, Get (inline and SHM) and Stats answer INTERNAL with a short message naming an error id that the
    server's log holds with the details; Put refuses that chunk and goes on; other requests are served meanwhile."""
    secret = ClusterSecret.generate()
    store = FailingStore(1 << 24, secret)
    b = Bridge(store=store, secret=secret)
    caplog.set_level(logging.ERROR, logger=server_mod.__name__)
    try:
        ok = chunk_bytes(b, "ok")
        s = b.client.put_bytes([("boom", ok), ("ok", ok)])  # Put: that chunk refused, the stream goes on
        assert (s.stored, s.refused_keys) == (1, ["boom"])
        calls = [lambda: b.client.lookup(["ok", "boom"]), lambda: b.client.get(["ok", "boom"]),
                 lambda: b.client.get(["ok", "boom"], transport="shm") if shm.available() else b.client.get(["boom"])]
        before = set(shm.list_segments(os.getpid()))
        errors = []
        for call in calls:
            with pytest.raises(BridgeError) as e:
                call()
            errors.append(e.value)
            assert b.client.lookup(["ok"]) == 1 and len(b.client.get(["ok"])) == 1  # others are served
        store.fail_stats = True
        with pytest.raises(BridgeError) as e:
            b.client.stats()
        errors.append(e.value)
        store.fail_stats = False
        assert set(shm.list_segments(os.getpid())) - before == set()  # the failed SHM stream's segments reclaimed
        ids = []
        for err in errors:
            text = str(err)
            assert err.code == grpc.StatusCode.INTERNAL, text
            assert SECRET_PATH not in text and "Traceback" not in text and "OSError" not in text, text
            ids.append(re.search(r"error id ([0-9a-f]{12})", text).group(1))
        logged = {r.getMessage(): r for r in caplog.records}
        for error_id in ids:  # each id names one logged failure, with its traceback and details
            (record,) = [r for m, r in logged.items() if error_id in m]
            assert record.exc_info is not None and SECRET_PATH in str(record.exc_info[1])
        c = b.counters()
        assert c["server.store_errors"] == 1 + len(errors)  # the Put's chunk, and each failed call
        assert c["server.invalid_requests"] == 0  # the store's failure, not the client's
        assert b.healthy_within(5.0)
    finally:
        b.stop()


# ---- counting rejections -----------------------------------------------------------------------------------

def test_every_client_caused_rejection_is_counted_once_in_invalid_requests(bridge):
    """invalid_requests counts each call refused INVALID_ARGUMENT (undecodable bytes included) and each Put chunk
    refused for what the client sent, exactly once; refusals that are not the client's fault are not counted."""
    counted = 0

    def invalid(call) -> None:
        nonlocal counted
        assert code_of(call) == grpc.StatusCode.INVALID_ARGUMENT
        counted += 1

    garbage = b"\xff\xff\xff\xff"
    for method in ("Lookup", "Stats", "Health"):  # undecodable unary requests
        raw = bridge.channel.unary_unary(f"/flashpd.kvbridge.v1.KVBridge/{method}")
        invalid(lambda: raw(garbage, timeout=TIMEOUT_S, metadata=bridge.md()))
    put = bridge.channel.stream_unary("/flashpd.kvbridge.v1.KVBridge/Put")
    get = bridge.channel.unary_stream("/flashpd.kvbridge.v1.KVBridge/Get")
    invalid(lambda: put(iter([garbage]), timeout=TIMEOUT_S, metadata=bridge.md()))
    invalid(lambda: list(get(garbage, timeout=TIMEOUT_S, metadata=bridge.md())))
    invalid(lambda: bridge.raw.Lookup(pb.LookupRequest(version=PROTOCOL_VERSION, keys=[""]),  # bad key
                                      timeout=TIMEOUT_S, metadata=bridge.md()))
    invalid(lambda: bridge.raw.Health(pb.HealthRequest(version=PROTOCOL_VERSION + 1),  # bad version
                                      timeout=TIMEOUT_S, metadata=bridge.md()))
    big = pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(  # oversized, refused on its first frame
        key="big", offset=0, total_length=server_mod.DEFAULT_MAX_CHUNK_BYTES + 1, data=b"x", last=False))
    invalid(lambda: bridge.raw.Put(iter([big]), timeout=TIMEOUT_S, metadata=bridge.md()))
    # chunks refused inside a Put that goes on: a bad header, a foreign MAC, a handle naming no segment
    forged = chunk_bytes(bridge, "mac", secret=ClusterSecret.generate())
    missing = f"fpkv-{os.getpid()}-{OWNER.put_tag}{uuid.uuid4().hex}"
    stream = [*frames("hdr", b"not a chunk"), *frames("mac", forged),
              pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
                  key="shm", offset=0, total_length=64, last=True, shm=pb.ShmHandle(name=missing, length=64))),
              *frames("good", chunk_bytes(bridge, "good"))]
    reply = bridge.raw.Put(iter(stream), timeout=TIMEOUT_S, metadata=bridge.md(owner=OWNER))
    assert (reply.stored, list(reply.refused_keys)) == (1, ["hdr", "mac", "shm"])
    counted += 3
    # not the client's fault, or counted elsewhere: a chunk larger than the whole store, a stranger's call
    small = Bridge(store=MemoryStore(64, bridge.secret), secret=bridge.secret)
    try:
        assert small.client.put_bytes([("k", chunk_bytes(small, "k"))]).refused == 1
        assert code_of(lambda: bridge.raw.Lookup(pb.LookupRequest(version=PROTOCOL_VERSION, keys=["k"]),
                                                 timeout=TIMEOUT_S)) == grpc.StatusCode.UNAUTHENTICATED
        assert small.counters()["server.invalid_requests"] == 0
    finally:
        small.stop()
    c = bridge.counters()
    assert c["server.invalid_requests"] == counted == 11
    assert c["server.unauthenticated_calls"] == 1

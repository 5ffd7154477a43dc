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

import os
import threading
import time

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
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2_grpc as pb_grpc
from flashpd.kv_bridge.server import MAX_REFUSED_KEYS
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
            assert stub.Health(gpb.HealthRequest(version=1), timeout=3.0).serving
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

def shm_handle_put(b: Bridge, name: str, length: int) -> pb.PutReply:
    frame = pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
        key="s", offset=0, total_length=length, last=True, shm=pb.ShmHandle(name=name, length=length)))
    return b.raw.Put(iter([frame]), timeout=TIMEOUT_S, metadata=b.md())


@needs_shm
def test_a_handle_naming_a_fifo_or_a_link_is_refused_without_blocking(bridge, tmp_path):
    data = chunk_bytes(bridge, "s")
    fifo = f"fpkv-test-fifo-{os.getpid()}"
    link = f"fpkv-test-link-{os.getpid()}"
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
        name = shm.write_segment(data)  # a real segment is taken
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
        assert bytes(got) == b"y" * 100 and isinstance(got, bytearray if writable else bytes)


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

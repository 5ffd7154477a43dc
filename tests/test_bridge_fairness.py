"""One client must not take from a bridge what other clients need, even while it keeps the rules StallGuard
enforces (real gRPC servers on 127.0.0.1, real files in /dev/shm):

- a Put that trickles a chunk (a byte now and then, never idle for idle_s) is ended and counted as stalled;
- partial chunks of all Put streams together are bounded: past the bound a chunk is refused before its
  buffer exists;
- a prompt put over several streams into a full store keeps its chain (a chunk never outruns its parent);
- a Put cannot make the server take or unlink a segment it handed to another client's SHM Get, nor any
  segment that fails its checks while its writer lives; one the server did not take goes once its writer died;
- a reader that never takes its SHM segments cannot starve another reader;
- keys and segment names are whole-string matches (no trailing newline).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable

import grpc
import pytest
import torch

from flashpd.kv_bridge import frame_codec, shm
from flashpd.kv_bridge import server as server_mod
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.chunk import KVChunk
from flashpd.kv_bridge.client import BridgeClient, BridgeError, _chains, _spread
from flashpd.kv_bridge.disk import DiskStore
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2_grpc as pb_grpc
from flashpd.kv_bridge.store import MemoryStore
from flashpd.kv_bridge.wire import PROTOCOL_VERSION, split_frames

from tests._kv_bridge_helpers import BridgeHarness, fingerprint, prompt_chunks

TIMEOUT_S = 10.0
WORKERS = 2
PUT = "/flashpd.kvbridge.v1.KVBridge/Put"

needs_shm = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm on this machine")


@pytest.fixture
def bridges():
    made: list[BridgeHarness] = []

    def make(**kw) -> BridgeHarness:
        kw.setdefault("timeout_s", TIMEOUT_S)
        made.append(BridgeHarness(**kw))
        return made[-1]

    yield make
    for b in made:
        b.stop()


def chunk_bytes(b: BridgeHarness | None, key: str) -> bytes:
    """A 32 KiB chunk sealed with b's secret (None: any secret, for its size)."""
    secret = b.secret if b is not None else ClusterSecret.generate()
    return KVChunk(key, "", "fp", list(range(64)), torch.zeros(1, 2, 64, 1, 64), None).to_bytes(secret.mac_key)


def put_frames(key: str, data: bytes, frame_bytes: int = 4096) -> list[pb.PutFrame]:
    return [pb.PutFrame(version=PROTOCOL_VERSION, frame=f) for f in split_frames(key, data, frame_bytes)]


def wait_for(cond, timeout_s: float = TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


# ---- Put: pace and in-flight bytes -------------------------------------------------------------------

def _trickled_puts_are_ended(b: BridgeHarness, frame: Callable[[int, int], bytes], idle_s: float) -> dict:
    """WORKERS Put streams, each sending frame(stream, i) every idle_s / 5 (never idle long enough for StallGuard):
    each must end DEADLINE_EXCEEDED by the bridge's byte floor while Health is served; the bridge's counters."""
    stop = threading.Event()

    def trickle(j: int):
        for i in range(int(30 / (idle_s / 5))):
            if stop.is_set():
                return
            yield frame(j, i)
            time.sleep(idle_s / 5)

    put = b.channel.stream_unary(PUT, response_deserializer=pb.PutReply.FromString)
    futs = [put.future(trickle(j), timeout=60, metadata=b.md()) for j in range(WORKERS)]
    try:
        for f in futs:
            with pytest.raises(grpc.RpcError) as e:
                f.result(timeout=TIMEOUT_S)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "bytes/s" in e.value.details()
        assert b.client.health(timeout_s=5.0)["serving"]
    finally:
        stop.set()
    return b.client.stats()


def _one_byte(key: bytes, off: int, total: int, last: bool) -> bytes:
    head, tail = frame_codec.frame_envelope(PROTOCOL_VERSION, key, off, total, 1, last)
    return head + b"x" + tail


def test_a_put_that_trickles_is_ended_and_counted_as_stalled(bridges):
    idle_s = 0.5
    b = bridges(max_workers=WORKERS, idle_s=idle_s)  # default floor: 1 MiB/s once idle_s have passed
    # one byte of a 1 MiB chunk a frame: the chunk's own floor
    c = _trickled_puts_are_ended(b, lambda j, i: _one_byte(f"slow{j}".encode(), i, 1 << 20, False), idle_s)
    assert (c["server.calls_stalled"], c["server.puts_too_slow"], c["server.inflight_bytes"]) == (WORKERS, WORKERS, 0)
    assert c["store.entries"] == 0


def test_a_put_of_small_chunks_that_trickles_is_ended_too(bridges):
    """Each chunk whole (here refused: one corrupt byte) and sent long before its own floor ends: per chunk the pace
    restarted, and such a stream held a worker for as long as it liked. The stream's bytes over its life must keep
    the floor too."""
    idle_s = 0.5
    b = bridges(max_workers=WORKERS, idle_s=idle_s)
    c = _trickled_puts_are_ended(b, lambda j, i: _one_byte(f"k{j}-{i}".encode(), 0, 1, True), idle_s)
    assert (c["server.calls_stalled"], c["server.puts_too_slow"]) == (WORKERS, WORKERS)
    assert c["server.chunks_refused_corrupt"] >= WORKERS and c["store.entries"] == 0


def test_a_get_read_a_frame_now_and_then_is_ended(bridges):
    """A reader that takes one 4 KiB frame every idle_s / 25 (200 KiB/s) is never idle for StallGuard, and a Get had
    no floor: such a reader held a worker for as long as its answer lasted (1 MiB here: 10 idle_s; a 4 MiB chunk at
    1 KiB/s: over an hour). Its stream must be taken at the Put floor (1 MiB/s) after the grace."""
    idle_s = 0.5
    b = bridges(max_workers=WORKERS, idle_s=idle_s)
    keys = [f"g{i}" for i in range(32)]
    assert b.client.put_bytes([(k, chunk_bytes(b, k)) for k in keys]).stored == len(keys)  # 32 x 32 KiB
    # no BDP probing: the flow-control window stays at its 64 KiB start, as a reader across a network sees it
    ch = grpc.insecure_channel(b.address, options=[("grpc.http2.bdp_probe", 0)])
    get = ch.unary_stream("/flashpd.kvbridge.v1.KVBridge/Get")
    call = get(pb.GetRequest(version=PROTOCOL_VERSION, keys=keys, frame_bytes=4096).SerializeToString(),
               timeout=60, metadata=b.md())
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            time.sleep(idle_s / 25)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "bytes/s" in e.value.details()
    assert time.monotonic() - t0 < 6 * idle_s  # not the whole 1 MiB at this pace (10 idle_s)
    ch.close()
    c = b.client.stats()
    assert (c["server.calls_stalled"], c["server.gets_too_slow"]) == (1, 1)
    assert len(b.client.get(keys)) == len(keys)  # a reader that takes its frames is served


@contextlib.contextmanager
def _one_chunk_in_flight(bridges):
    """A bridge whose in-flight bound has room for one chunk, and a Put stream holding that one (its first frame
    sent, the rest never): yields (the bridge, the stream's future); the stream ends on leaving."""
    size = len(chunk_bytes(None, "k"))
    b = bridges(max_workers=4, idle_s=60.0, inflight_max_bytes=size + size // 2)
    release = threading.Event()

    def first_frame_then_wait():
        yield put_frames("h", chunk_bytes(b, "h"))[0]  # as long as any test chunk
        release.wait()

    held = b.raw.Put.future(first_frame_then_wait(), timeout=60, metadata=b.md())
    try:
        assert wait_for(lambda: b.client.stats()["server.inflight_bytes"] == size)
        yield b, held
    finally:
        release.set()


def test_partial_chunks_of_all_puts_are_bounded_and_refused_before_buffering(bridges):
    with _one_chunk_in_flight(bridges) as (b, held):
        data = chunk_bytes(b, "k")
        with pytest.raises(BridgeError) as e:
            b.client.put_bytes([("k", data)])
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in str(e.value)
        assert b.client.stats()["server.puts_refused_inflight"] == 1
    assert list(held.result(timeout=TIMEOUT_S).incomplete_keys) == ["h"]
    assert b.client.stats()["server.inflight_bytes"] == 0  # the ended stream gave its bytes back
    assert b.client.put_bytes([("k", data)]).stored == 1


@needs_shm
def test_a_same_host_put_counts_in_the_in_flight_bound_too(bridges):
    """A Put by shared-memory handle read its segment into fresh memory outside the in-flight bound: four 96 MiB
    Puts went past a 16 MiB bound. Its bytes are held in the bound while the chunk is taken and stored."""
    with _one_chunk_in_flight(bridges) as (b, held):
        data = chunk_bytes(b, "k")
        with pytest.raises(BridgeError) as e:
            b.client.put_bytes([("k", data)], transport="shm")
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in str(e.value)
        assert b.client.stats()["server.puts_refused_inflight"] == 1
    held.result(timeout=TIMEOUT_S)
    assert b.client.put_bytes([("k", data)], transport="shm").stored == 1
    assert b.client.stats()["server.inflight_bytes"] == 0


@needs_shm
def test_a_foreign_handle_under_a_busy_bound_is_still_refused_alone(bridges):
    """The handle is checked before the bound is asked: a segment that is not the caller's is that chunk's refusal,
    the stream going on, however busy the bound (it was RESOURCE_EXHAUSTED for the whole stream)."""
    with _one_chunk_in_flight(bridges) as (b, held):
        foreign = f"fpkv-{os.getpid()}-{shm.SegmentOwner.generate().put_tag}{uuid.uuid4().hex}"
        reply = shm_put(b, foreign, len(chunk_bytes(b, "f")), key="f")
        assert (reply.stored, list(reply.refused_keys)) == (0, ["f"])
        assert b.client.stats()["server.shm_put_segments_not_owned"] == 1
        assert b.client.stats()["server.puts_refused_inflight"] == 0
    held.result(timeout=TIMEOUT_S)


# ---- Put over several streams: a chain stays on one stream -------------------------------------------

def test_chains_stay_on_one_stream_in_order_and_chains_spread():
    item = lambda key, parent="": (key, list, False, parent)  # noqa: E731
    items = [item("a0"), item("b0"), item("a1", "a0"), item("c0", "elsewhere"), item("b1", "b0"), item("a2", "a1")]
    chains = _chains(items)
    assert [[i[0] for i in c] for c in chains] == [["a0", "a1", "a2"], ["b0", "b1"], ["c0"]]
    shares = _spread(chains, 2)
    assert [[i[0] for i in s] for s in shares] == [["a0", "a1", "a2"], ["b0", "b1", "c0"]]
    assert len(_spread(_chains([item(f"x{i}") for i in range(9)]), 4)) == 4  # unrelated chunks use every stream


def test_a_prompt_put_over_several_streams_into_a_full_store_keeps_its_chain(bridges):
    secret = ClusterSecret.generate()
    store = MemoryStore(1 << 20, secret)
    b = bridges(store=store, secret=secret)
    with BridgeClient(b.address, TIMEOUT_S, secret=b.secret, streams=1) as one:
        filler = prompt_chunks(list(range(100000, 100000 + 16 * 200)), fingerprint("filler"))
        one.put(filler)  # one chain, in order, until the store is full
    assert store.stats()["bytes"] > store.byte_budget - 8192
    prompt = prompt_chunks(list(range(16 * 16)), fingerprint(), seed=1)
    with BridgeClient(b.address, TIMEOUT_S, secret=b.secret, streams=4) as four:
        s = four.put(prompt)
        assert (s.stored, s.refused) == (16, 0)
        assert four.lookup([c.key for c in prompt]) == 16
        other = prompt_chunks(list(range(16 * 16)), fingerprint("drafter-b"), seed=2)
        raw = [(c.key, c.to_bytes(b.secret.mac_key)) for c in other]
        s = four.put_bytes(raw)  # the parent is read from each chunk's header
        assert (s.stored, s.refused) == (16, 0)


# ---- SHM Put: never a deputy for unlinking someone else's segment ------------------------------------

OWNER = shm.SegmentOwner.generate()  # this test process's Put segments (as a BridgeClient's)


def shm_put(b: BridgeHarness, name: str, length: int, key: str = "s",
            owner: shm.SegmentOwner | None = OWNER) -> pb.PutReply:
    frame = pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
        key=key, offset=0, total_length=length, last=True, shm=pb.ShmHandle(name=name, length=length)))
    return b.raw.Put(iter([frame]), timeout=TIMEOUT_S, metadata=b.md(owner=owner))


@needs_shm
def test_a_put_cannot_take_or_unlink_a_segment_handed_to_another_clients_get(bridges):
    b = bridges()
    data = chunk_bytes(b, "victim")
    assert b.client.put_bytes([("victim", data)]).stored == 1
    get = b.raw.Get(pb.GetRequest(version=PROTOCOL_VERSION, keys=["victim"], transport=pb.SHM),
                    timeout=TIMEOUT_S, metadata=b.md())
    handle = next(get).frame.shm  # handed over, not taken yet
    assert shm.handed_out(handle.name)
    for length in (1, handle.length):  # a wrong length, and the right one
        reply = shm_put(b, handle.name, length)
        assert (reply.stored, list(reply.refused_keys)) == (0, ["s"])
        assert os.path.exists(shm.SHM_DIR / handle.name)
    assert shm.take_segment(handle.name, handle.length) == data  # the victim still gets its bytes
    list(get)


@needs_shm
def test_a_segment_that_fails_a_check_is_left_in_place(bridges):
    b = bridges()
    data = chunk_bytes(b, "s")
    name = shm.write_segment(data, OWNER.put_tag)  # a same-host client's Put segment, named with a wrong length
    try:
        assert shm_put(b, name, len(data) - 1).refused == 1
        assert os.path.exists(shm.SHM_DIR / name)
        if os.geteuid() == 0:  # another user's file: refused, never read nor unlinked
            os.chown(shm.SHM_DIR / name, 54321, 54321)
            with pytest.raises(shm.ShmError, match="another user"):
                shm.take_segment(name, len(data))
            assert shm_put(b, name, len(data)).refused == 1
            assert os.path.exists(shm.SHM_DIR / name)
            os.chown(shm.SHM_DIR / name, 0, 0)
        assert shm_put(b, name, len(data)).stored == 1  # the right length: taken and unlinked
        assert not os.path.exists(shm.SHM_DIR / name)
    finally:
        shm.unlink_segment(name)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def dead_clients_segment(data: bytes) -> tuple[str, shm.SegmentOwner]:
    """A Put segment written as BridgeClient writes one, by a process that then exited without unlinking it,
    and that process's owner (what its Put presented)."""
    code = ("import sys; from flashpd.kv_bridge import shm; o = shm.SegmentOwner.generate(); "
            "print(shm.write_segment(sys.stdin.buffer.read(), o.put_tag), o.metadata()[1])")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True, timeout=120)
    name, key = out.stdout.decode().split()
    return name, shm.SegmentOwner(bytes.fromhex(key))


def put_segment_file(pid: int, tag: str = OWNER.put_tag, data: bytes = b"x" * 64) -> str:
    name = f"{shm.PREFIX}{pid}-{tag}{uuid.uuid4().hex}"
    fd = os.open(shm.SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    shm.write_all(fd, data)
    os.close(fd)
    return name


@needs_shm
def test_a_refused_put_segment_goes_once_its_writer_died_and_a_live_writers_stays(bridges, monkeypatch):
    """A client that dies after its Put was refused leaves its segment to the server, which unlinks it after the
    grace; a live client's refused segment stays (it may send it again: the retry is served)."""
    monkeypatch.setattr(shm, "PUT_LEFTOVER_GRACE_S", 0.3)
    monkeypatch.setattr(server_mod, "PUT_SWEEP_EVERY_S", 0.05, raising=False)  # a bridge without it fails below
    b = bridges()
    data = chunk_bytes(b, "s")
    dead, dead_owner = dead_clients_segment(data)
    live = shm.write_segment(data, OWNER.put_tag)
    assert shm.put_writer(dead) not in (None, os.getpid()) and shm.put_writer(live) == os.getpid()
    try:
        for name, owner in ((dead, dead_owner), (live, OWNER)):
            assert shm_put(b, name, len(data) - 1, owner=owner).refused == 1  # a wrong length: refused, left in place
            assert os.path.exists(shm.SHM_DIR / name)
        assert wait_for(lambda: not os.path.exists(shm.SHM_DIR / dead))
        time.sleep(shm.PUT_LEFTOVER_GRACE_S + 10 * server_mod.PUT_SWEEP_EVERY_S)  # sweeps past the live one's grace
        assert os.path.exists(shm.SHM_DIR / live)
        assert shm_put(b, live, len(data)).stored == 1  # its writer's retry, with the right length
        assert not os.path.exists(shm.SHM_DIR / live)
        c = b.client.stats()
        assert (c["server.shm_put_segments_left"], c["server.shm_put_segments_reclaimed"]) == (2, 1)
    finally:
        shm.unlink_segment(dead)
        shm.unlink_segment(live)


@needs_shm
def test_put_leftovers_unlink_only_a_dead_writers_put_segment_still_the_file_seen(monkeypatch, tmp_path):
    """What PutLeftovers keeps and unlinks: Put segments only (not a Get's, not an untagged name, not a link),
    of a writer that is gone, after the grace, and only the very file a Put named (not one put in its place)."""
    gone_pid = dead_pid()
    left = shm.PutLeftovers()
    gone, replaced, mine = put_segment_file(gone_pid), put_segment_file(gone_pid), put_segment_file(os.getpid())
    others = [put_segment_file(gone_pid, tag=""), put_segment_file(gone_pid, tag=shm.GET_TAG)]
    link = f"{shm.PREFIX}{gone_pid}-{OWNER.put_tag}{uuid.uuid4().hex}"
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    os.symlink(target, shm.SHM_DIR / link)
    missing = f"{shm.PREFIX}{gone_pid}-{OWNER.put_tag}{uuid.uuid4().hex}"
    names = [gone, replaced, mine, *others, link, missing]
    try:
        assert [left.note(n) for n in names] == [True, True, True, False, False, False, False]
        fresh = put_segment_file(gone_pid)  # another file takes `replaced`'s name after it was seen
        os.replace(shm.SHM_DIR / fresh, shm.SHM_DIR / replaced)
        assert left.reclaim() == 0  # within the grace: nothing goes
        monkeypatch.setattr(shm, "PUT_LEFTOVER_GRACE_S", 0.0)
        assert left.reclaim() == 1
        assert not os.path.exists(shm.SHM_DIR / gone)
        assert all(os.path.lexists(shm.SHM_DIR / n) for n in (replaced, mine, *others, link))
        assert target.read_bytes() == b"keep" and len(left) == 1  # `mine` (a live writer) is still watched
        monkeypatch.setattr(shm, "MAX_PUT_LEFTOVERS", 2)
        extra = [put_segment_file(gone_pid) for _ in range(2)]
        names += extra
        assert all(left.note(n) for n in extra) and len(left) == 2  # bounded: `mine` forgotten (left in place)
        assert left.reclaim() == 2 and os.path.exists(shm.SHM_DIR / mine)
    finally:
        for n in names:
            try:
                os.unlink(shm.SHM_DIR / n)
            except FileNotFoundError:
                pass


# ---- SHM Get: one reader cannot starve another -----------------------------------------------------

def hog_gets(b: BridgeHarness, keys: list[str]) -> tuple[list[str], grpc.RpcError | None]:
    """Single-key SHM Gets on the raw channel (one peer) whose segments are never taken."""
    got = []
    for k in keys:
        try:
            msgs = list(b.raw.Get(pb.GetRequest(version=PROTOCOL_VERSION, keys=[k], transport=pb.SHM),
                                  timeout=TIMEOUT_S * 2, metadata=b.md()))
        except grpc.RpcError as e:
            return got, e
        got.append(msgs[0].frame.shm.name)
    return got, None


def sized_bridge(bridges, n_keys: int, **kw) -> tuple[BridgeHarness, list[str], int]:
    size = len(chunk_bytes(None, "c0"))
    b = bridges(**{k: (v(size) if callable(v) else v) for k, v in kw.items()})
    keys = [f"c{i}" for i in range(n_keys)]
    assert b.client.put_bytes([(k, chunk_bytes(b, k)) for k in keys]).stored == n_keys
    return b, keys, size


@needs_shm
def test_a_reader_that_never_takes_its_segments_is_refused_at_once_and_others_are_served(bridges, monkeypatch):
    monkeypatch.setattr(server_mod, "SHM_ROOM_WAIT_S", 1.0)
    b, keys, size = sized_bridge(bridges, 8, shm_max_bytes=lambda s: 4 * s + s // 2)  # a share: ~1 segment
    taken, err = hog_gets(b, keys[:5])
    try:
        assert len(taken) == 1 and err is not None
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "never took" in err.details()
        assert [c.key for c in b.client.get(keys[4:], transport="shm")] == keys[4:]
        c = b.client.stats()
        assert (c["server.shm_gets_refused_peer"], c["server.shm_gets_refused_full"]) == (1, 0)
    finally:
        for name in taken:
            shm.unlink_segment(name)


@needs_shm
def test_a_get_waiting_for_room_sweeps_expired_segments_meanwhile(bridges):
    b, keys, size = sized_bridge(bridges, 2, shm_max_bytes=lambda s: s + s // 2, shm_peer_max_bytes=1 << 30,
                                 shm_ttl_s=2.0)
    taken, err = hog_gets(b, keys[:1])  # fills the ledger (its share is the whole of it here)
    assert err is None and os.path.exists(shm.SHM_DIR / taken[0])
    assert [c.key for c in b.client.get(keys[1:], transport="shm")] == keys[1:]  # within SHM_ROOM_WAIT_S
    assert not os.path.exists(shm.SHM_DIR / taken[0])
    assert b.client.stats()["server.shm_segments_expired"] == 1


@needs_shm
def test_a_finished_gets_segments_beyond_its_share_expire_for_a_waiting_reader(bridges, monkeypatch):
    monkeypatch.setattr(shm, "OVER_SHARE_TTL_S", 0.2)
    monkeypatch.setattr(server_mod, "SHM_ROOM_WAIT_S", 5.0)
    b, keys, size = sized_bridge(bridges, 2, shm_max_bytes=lambda s: s + s // 2)  # one segment; share < one
    taken, err = hog_gets(b, keys[:1])
    assert err is None
    assert [c.key for c in b.client.get(keys[1:], transport="shm")] == keys[1:]
    assert not os.path.exists(shm.SHM_DIR / taken[0])
    assert b.client.stats()["server.shm_segments_expired"] == 1  # counted as the TTL sweep's are


def _hog_on_own_channel(b: BridgeHarness, key: str) -> tuple[str, grpc.Channel]:
    """One SHM Get on a connection of its own (another peer to the ledger), its segment never taken."""
    ch = grpc.insecure_channel(b.address, options=[("grpc.use_local_subchannel_pool", 1)])
    stub = pb_grpc.KVBridgeStub(ch)
    msgs = list(stub.Get(pb.GetRequest(version=PROTOCOL_VERSION, keys=[key], transport=pb.SHM),
                         timeout=TIMEOUT_S, metadata=b.md()))
    return msgs[0].frame.shm.name, ch


@needs_shm
def test_a_client_at_its_share_on_many_connections_cannot_keep_the_others_out(bridges, monkeypatch):
    """Four connections of one client, each holding its share (a quarter) of untaken segments, fill the total:
    another client's SHM Get is served once they are OVER_SHARE_TTL_S old. Expired only past their peer's share,
    they stayed, and the Get waited out SHM_ROOM_WAIT_S and failed (a peer is a connection: BridgeClient opens 4)."""
    monkeypatch.setattr(shm, "OVER_SHARE_TTL_S", 0.2)
    monkeypatch.setattr(server_mod, "SHM_ROOM_WAIT_S", 3.0)
    b, keys, size = sized_bridge(bridges, 5, shm_max_bytes=lambda s: 4 * s + s // 2,
                                 shm_peer_max_bytes=lambda s: s + s // 2)
    held = [_hog_on_own_channel(b, k) for k in keys[:4]]
    try:
        assert len({ch for _, ch in held}) == 4 and all(os.path.exists(shm.SHM_DIR / n) for n, _ in held)
        t0 = time.monotonic()
        assert [c.key for c in b.client.get(keys[4:], transport="shm")] == keys[4:]
        assert time.monotonic() - t0 < 2.5
        assert sum(not os.path.exists(shm.SHM_DIR / n) for n, _ in held) >= 1  # the oldest made room
    finally:
        for name, ch in held:
            shm.unlink_segment(name)
            ch.close()


@needs_shm
def test_gets_waiting_for_room_are_bounded_and_one_more_is_refused_at_once(bridges, monkeypatch):
    """Every waiting Get holds a server thread: past MAX_ROOM_WAITERS the next is refused at once (counted), not
    queued, so waiting Gets cannot take every thread from the bridge's other calls."""
    monkeypatch.setattr(shm, "MAX_ROOM_WAITERS", 1)
    monkeypatch.setattr(server_mod, "SHM_ROOM_WAIT_S", 3.0)
    b, keys, size = sized_bridge(bridges, 3, shm_max_bytes=lambda s: s + s // 2, shm_peer_max_bytes=1 << 30,
                                 shm_ttl_s=60.0)
    taken, err = hog_gets(b, keys[:1])  # fills the ledger; it does not expire within the test
    assert err is None
    monkeypatch.setattr(shm, "OVER_SHARE_TTL_S", 60.0)
    waiter_err: list = []
    waiting = threading.Event()  # set in the ledger's lock, where a Get that found no room counts itself waiting
    expire_for = shm.SegmentLedger._expire_for
    monkeypatch.setattr(shm.SegmentLedger, "_expire_for", lambda self, *a: (waiting.set(), expire_for(self, *a))[1])

    def wait_for_room() -> None:
        try:
            b.client.get(keys[1:2], transport="shm")
        except Exception as e:  # noqa: BLE001  it runs out of time: RESOURCE_EXHAUSTED
            waiter_err.append(e)

    t = threading.Thread(target=wait_for_room)
    try:
        t.start()
        assert waiting.wait(10.0)  # the first is waiting now (a sleep was a guess on a loaded machine)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="waiting for shared-memory room already"):
            b.client.get(keys[2:], transport="shm")
        assert time.monotonic() - t0 < 1.5
        assert b.client.stats()["server.shm_gets_refused_waiting"] == 1
    finally:
        t.join(10)
        for name in taken:
            shm.unlink_segment(name)


# ---- names ------------------------------------------------------------------------------------------------

def test_keys_and_segment_names_with_a_trailing_newline_are_refused(tmp_path):
    assert shm.valid_name("fpkv-1-abc") and not shm.valid_name("fpkv-1-abc\n")
    with pytest.raises(shm.ShmError, match="not a bridge segment name"):
        shm.take_segment("fpkv-1-abc\n", 10)
    store = DiskStore(tmp_path, 1 << 20)
    with pytest.raises(ValueError, match="not a valid file name"):
        store.put_bytes("abc\n", b"x" * 64)

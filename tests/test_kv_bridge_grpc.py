"""The KV bridge over a real gRPC server on 127.0.0.1 (in-process, port 0): transfer, validation,
failure handling (corrupt, truncated, cancelled, timed out, restarted), SHM, generated-code drift."""
from __future__ import annotations

import filecmp
import os
import threading
import time

import grpc
import pytest
import torch

from flashpd.kv_bridge import frame_codec, shm
from flashpd.kv_bridge.auth import MAC_BYTES
from flashpd.kv_bridge.chunk import CorruptChunk, StreamingMac, verify_bytes
from flashpd.kv_bridge.client import (BridgeClient, BridgeError, BridgeInvalidArgument, BridgeProtocolError,
                                      BridgeTimeout, BridgeUnavailable, RemoteStore)
from flashpd.kv_bridge.disk import DiskStore, TieredStore
from flashpd.kv_bridge.keys import chunk_keys
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb
from flashpd.kv_bridge.server import serve
from flashpd.kv_bridge.store import MemoryStore
from flashpd.kv_bridge.wire import MIN_FRAME_BYTES, PROTOCOL_VERSION, Assembler, frame_pieces, split_frames

try:
    from tests._kv_bridge_helpers import CHUNK_TOKENS, MAC, fingerprint, flip_byte, make_chunk, prompt_chunks, same
except ImportError:
    from _kv_bridge_helpers import (CHUNK_TOKENS, MAC, fingerprint, flip_byte, make_chunk,  # type: ignore
                                    prompt_chunks, same)

FRAME = 4096  # the minimum frame size: every test chunk (~6 KB) spans several frames
TIMEOUT_S = 10.0


class Bridge:
    """A started server on a loopback port and a client to it; stop() in teardown."""

    def __init__(self, store, **serve_kw) -> None:
        self.store = store
        self.server, self.port = serve(store, max_workers=8, **serve_kw)
        self.address = f"127.0.0.1:{self.port}"
        self.client = BridgeClient(self.address, timeout_s=TIMEOUT_S, frame_bytes=FRAME)

    def stop(self) -> None:
        self.client.close()
        self.server.stop(grace=None).wait(TIMEOUT_S)


@pytest.fixture
def bridge():
    b = Bridge(MemoryStore(1 << 24))
    yield b
    b.stop()


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def frames_of(key: str, data: bytes, version: int = PROTOCOL_VERSION) -> list[pb.PutFrame]:
    return [pb.PutFrame(version=version, frame=f) for f in split_frames(key, data, FRAME)]


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_round_trip_byte_exact(bridge, transport):
    chunks = [make_chunk(f"k{i}", dtype=dt, draft=d, seed=i)
              for i, (dt, d) in enumerate([(torch.bfloat16, True), (torch.bfloat16, False),
                                           (torch.float32, True), (torch.float32, False)])]
    assert len(chunks[2].to_bytes(MAC)) > 2 * FRAME  # multi-frame
    s = bridge.client.put(chunks, transport=transport)
    assert (s.stored, s.ok) == (4, True)
    got = bridge.client.get([c.key for c in chunks], transport=transport)
    assert len(got) == 4 and all(same(a, b) for a, b in zip(got, chunks))
    assert got[2].target_kv.dtype == torch.float32 and got[1].draft_kv is None
    assert shm.list_segments(os.getpid()) == []  # every segment taken and unlinked
    again = bridge.client.put(chunks, transport=transport)
    assert (again.stored, again.duplicates) == (0, 4)
    # an import owns what it received: both halves are views of one writable buffer, not copies
    tk, dk = got[0].target_kv, got[0].draft_kv
    assert dk.data_ptr() == tk.data_ptr() + tk.numel() * tk.element_size()  # adjacent in the received bytes


def test_chunks_read_from_a_store_are_copies():
    """A store's bytes stay its own: a chunk read from it may be written to without touching the entry."""
    store = MemoryStore(1 << 24)
    c = make_chunk("k", dtype=torch.float32, draft=True, seed=3)
    store.put(c)
    got = store.get("k")
    got.target_kv.add_(1.0)
    got.draft_kv.zero_()
    assert same(store.get("k"), c)


def test_a_shared_read_is_a_view_of_the_entry_and_verified_as_a_get_is():
    """get_shared (a restore's read: it only copies the tensors out) hands out views of the entry's immutable bytes,
    not copies; get still copies (above). Both verify the entry first and count the hit."""
    store = MemoryStore(1 << 24)
    c = make_chunk("k", dtype=torch.float32, draft=True, seed=3)
    store.put(c)
    a, b = store.get_shared("k"), store.get_shared("k")
    assert same(a, c) and same(b, c)
    assert a.target_kv.data_ptr() == b.target_kv.data_ptr() and a.draft_kv.data_ptr() == b.draft_kv.data_ptr()
    assert store.get("k").target_kv.data_ptr() != a.target_kv.data_ptr()
    assert store.get_shared("missing") is None and store.stats()["hits"] == 3


def test_lookup_and_get_stop_at_first_missing_key(bridge):
    bridge.client.put([make_chunk(k) for k in ("a", "b", "d")])
    assert bridge.client.lookup(["a", "b", "c", "d"]) == 2
    assert bridge.client.lookup(["c", "a"]) == 0
    got = bridge.client.get(["a", "b", "c", "d"])
    assert [c.key for c in got] == ["a", "b"]
    assert bridge.client.get(["zz", "a"]) == []


def test_wrong_fingerprint_never_hits(bridge):
    tokens = list(range(7, 7 + 3 * CHUNK_TOKENS))
    fp_dflash, fp_native = fingerprint("drafter-a"), fingerprint("none")
    bridge.client.put(prompt_chunks(tokens, fp_dflash))
    keys_native = chunk_keys(tokens, CHUNK_TOKENS, fp_native)
    assert bridge.client.lookup(chunk_keys(tokens, CHUNK_TOKENS, fp_dflash)) == 3
    assert bridge.client.lookup(keys_native) == 0 and bridge.client.get(keys_native) == []


def test_lru_eviction_over_the_bridge_drops_whole_entries():
    n = len(make_chunk("x").to_bytes(MAC))
    b = Bridge(MemoryStore(2 * n + n // 2))
    try:
        for i, k in enumerate("abc"):  # one call each: the streams of one call reach the store in any order
            b.client.put([make_chunk(k, seed=i)])
        assert b.client.lookup(["a"]) == 0 and b.client.lookup(["b", "c"]) == 2
        got = b.client.get(["b", "c"])
        assert all(c.draft_kv is not None and c.target_kv is not None for c in got)
        assert b.client.stats()["store.evictions"] == 1
    finally:
        b.stop()


def test_corrupt_chunk_refused_at_put_and_counted(bridge):
    good, bad = make_chunk("good"), make_chunk("bad", seed=1).to_bytes(MAC)
    s = bridge.client.put_bytes([("bad", flip_byte(bad, len(bad) // 2)), ("good", good.to_bytes(MAC)),
                                 ("wrongkey", bad)])
    assert (s.stored, s.refused_keys) == (1, ["bad", "wrongkey"])
    assert bridge.client.lookup(["bad"]) == 0 and bridge.client.lookup(["wrongkey"]) == 0
    st = bridge.client.stats()
    assert st["server.chunks_refused_corrupt"] == 2 and st["store.corrupt_refused"] == 2
    assert same(bridge.client.get(["good"])[0], good)


def test_truncated_stream_leaves_no_entry(bridge):
    data = make_chunk("cut").to_bytes(MAC)
    frames = frames_of("cut", data)
    assert len(frames) >= 2
    half = frames[: len(frames) // 2]
    # 1) the client half-closes after half the frames: dropped and reported
    reply = bridge.client.stub.Put(iter(half), timeout=TIMEOUT_S)
    assert (reply.stored, list(reply.incomplete_keys)) == (0, ["cut"])
    # 2) the client cancels with half the frames sent and the stream still open
    sent, release = threading.Event(), threading.Event()

    def stalled():
        yield from half
        sent.set()
        release.wait(TIMEOUT_S)

    fut = bridge.client.stub.Put.future(stalled(), timeout=TIMEOUT_S)
    assert sent.wait(TIMEOUT_S)
    assert wait_until(lambda: bridge.client.stats()["server.frames_received"] >= 2 * len(half))
    fut.cancel()
    release.set()
    with pytest.raises(grpc.FutureCancelledError):
        fut.result(timeout=TIMEOUT_S)
    assert bridge.client.lookup(["cut"]) == 0 and bridge.client.get(["cut"]) == []
    assert bridge.store.stats()["entries"] == 0
    assert bridge.client.health()["serving"]


def test_concurrent_puts_of_one_key(bridge):
    c = make_chunk("same", seed=5)
    barrier = threading.Barrier(8, timeout=TIMEOUT_S)
    summaries = []

    def worker() -> None:
        with BridgeClient(bridge.address, TIMEOUT_S, frame_bytes=FRAME) as cl:
            barrier.wait()
            summaries.append(cl.put([c]))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive()
    assert sum(s.stored for s in summaries) == 1 and sum(s.duplicates for s in summaries) == 7
    assert bridge.store.stats()["entries"] == 1
    assert same(bridge.client.get(["same"])[0], c)


def test_server_validation_names_the_field(bridge):
    stub = bridge.client.stub
    cases = [
        (lambda: stub.Lookup(pb.LookupRequest(version=PROTOCOL_VERSION), timeout=TIMEOUT_S), "keys"),
        (lambda: stub.Lookup(pb.LookupRequest(version=7, keys=["a"]), timeout=TIMEOUT_S), "version"),
        (lambda: stub.Lookup(pb.LookupRequest(keys=["a"]), timeout=TIMEOUT_S), "version"),
        (lambda: list(stub.Get(pb.GetRequest(version=PROTOCOL_VERSION), timeout=TIMEOUT_S)), "keys"),
        (lambda: stub.Stats(pb.StatsRequest(version=2), timeout=TIMEOUT_S), "version"),
    ]
    data = make_chunk("k", dtype=torch.float32).to_bytes(MAC)
    f = frames_of("k", data)
    assert len(f) >= 3
    cases += [
        (lambda: stub.Put(iter([f[0], f[2]]), timeout=TIMEOUT_S), "frame.offset"),
        (lambda: stub.Put(iter([f[1]]), timeout=TIMEOUT_S), "frame.offset"),
        (lambda: stub.Put(iter(frames_of("k", data, version=9)), timeout=TIMEOUT_S), "version"),
        (lambda: stub.Put(iter([pb.PutFrame(version=1, frame=pb.ChunkFrame(
            key="k", offset=0, total_length=10, data=b"x" * 11, last=True))]), timeout=TIMEOUT_S), "frame.data"),
        (lambda: stub.Put(iter([pb.PutFrame(version=1, frame=pb.ChunkFrame(
            offset=0, total_length=1, data=b"x", last=True))]), timeout=TIMEOUT_S), "frame.key"),
    ]
    for call, field_name in cases:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert e.value.details().startswith(field_name), e.value.details()
    with pytest.raises(BridgeInvalidArgument, match="keys"):  # the client maps it to a ValueError
        bridge.client.lookup([""])
    assert bridge.client.lookup(["k"]) == 0 and bridge.client.health()["serving"]


class SlowStore:
    """Delays lookups while `slow` is set: a server that cannot answer within a tiny deadline."""

    def __init__(self, inner: MemoryStore, delay_s: float) -> None:
        self.inner, self.delay_s, self.slow = inner, delay_s, threading.Event()

    def lookup(self, keys):
        if self.slow.is_set():
            time.sleep(self.delay_s)
        return self.inner.lookup(keys)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_client_timeout_raises_and_server_keeps_serving():
    store = SlowStore(MemoryStore(1 << 24), delay_s=1.0)
    b = Bridge(store)
    try:
        b.client.put([make_chunk("a")])
        store.slow.set()
        t0 = time.monotonic()
        with pytest.raises(BridgeTimeout, match="Lookup") as e:
            b.client.lookup(["a"], timeout_s=0.05)
        assert isinstance(e.value, TimeoutError) and time.monotonic() - t0 < 0.9
        store.slow.clear()
        assert b.client.lookup(["a"]) == 1 and same(b.client.get(["a"])[0], make_chunk("a"))
    finally:
        b.stop()


def test_after_a_timeout_calls_are_skipped_for_the_cooloff_then_tried_again():
    """A hung bridge (its store stalls) cost each caller a whole timeout; with cooloff_s a client that saw one
    fails its next calls at once (BridgeUnavailable, which every caller takes as a miss) until the cool-off ends;
    Health still probes; a call after it goes through and clears it."""
    store = SlowStore(MemoryStore(1 << 24), delay_s=1.0)
    b = Bridge(store)
    cl = BridgeClient(b.address, timeout_s=0.2, frame_bytes=FRAME, cooloff_s=0.8)
    try:
        b.client.put([make_chunk("a")])
        store.slow.set()
        with pytest.raises(BridgeTimeout):
            cl.lookup(["a"])
        t0 = time.monotonic()
        for call in (lambda: cl.lookup(["a"]), lambda: cl.get(["a"]), lambda: cl.put([make_chunk("b")])):
            with pytest.raises(BridgeUnavailable, match="skipped"):
                call()
        # none waited for the hung bridge: each raised "skipped", and three waits of the 0.2 s timeout would take
        # 0.6 s (a bound that a loaded machine's scheduling does not reach, as it might 0.15 s)
        assert time.monotonic() - t0 < 0.6 and cl.skipped_calls == 3
        assert cl.health()["serving"]  # a probe is never skipped
        assert b.client.lookup(["b"]) == 0  # the skipped Put never reached the bridge
        store.slow.clear()
        time.sleep(0.85)
        assert cl.lookup(["a"]) == 1 and same(cl.get(["a"])[0], make_chunk("a"))
        with BridgeClient(b.address, timeout_s=0.2, frame_bytes=FRAME) as plain:  # cooloff_s 0: never skips
            store.slow.set()
            for _ in range(2):
                with pytest.raises(BridgeTimeout):
                    plain.lookup(["a"])
            assert plain.skipped_calls == 0
    finally:
        cl.close()
        b.stop()


def test_unreachable_bridge_raises_connection_error():
    b = Bridge(MemoryStore(1 << 20))
    address = b.address
    b.stop()
    with BridgeClient(address, timeout_s=2.0) as cl:
        with pytest.raises(BridgeUnavailable, match="Health") as e:
            cl.health()
        assert isinstance(e.value, ConnectionError)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_cancelled_get_stream_leaves_server_healthy(bridge, transport):
    chunks = [make_chunk(f"c{i}", seed=i) for i in range(8)]
    bridge.client.put(chunks)
    it = bridge.client.iter_get([c.key for c in chunks], transport=transport)
    assert same(next(it), chunks[0])
    it.close()  # stops mid-way (inline: cancels; shm: also unlinks every handle the server sent)
    assert shm.list_segments(os.getpid()) == []
    got = bridge.client.get([c.key for c in chunks], transport=transport)
    assert len(got) == 8 and all(same(a, b) for a, b in zip(got, chunks))
    assert bridge.client.health()["serving"]


def _raw_shm_get(b: Bridge, n: int):
    """n chunks put in b, and a raw SHM Get of them (its handles not taken by any client code)."""
    chunks = [make_chunk(f"c{i}", seed=i) for i in range(n)]
    b.client.put(chunks)
    return chunks, b.client.stub.Get(pb.GetRequest(version=PROTOCOL_VERSION, keys=[c.key for c in chunks],
                                                   transport=pb.SHM), timeout=TIMEOUT_S)


def test_raw_cancelled_shm_stream_segments_expire():
    """A reader that cancels (or dies) without taking its handles: the server unlinks the segments
    of an unfinished stream, and the ones it had already handed out expire after shm_ttl_s."""
    b = Bridge(MemoryStore(1 << 24), shm_ttl_s=0.2)
    try:
        chunks, call = _raw_shm_get(b, 8)
        first = next(call)
        assert same(make_chunk("c0", seed=0), b.client.get(["c0"])[0])
        shm.unlink_segment(first.frame.shm.name)
        call.cancel()
        time.sleep(0.3)
        assert len(b.client.get([c.key for c in chunks], transport="shm")) == 8  # sweeps expired ones
        assert wait_until(lambda: shm.list_segments(os.getpid()) == [])
        st = b.client.stats()
        assert st["server.shm_segments_reclaimed"] + st["server.shm_segments_expired"] >= 1
    finally:
        b.stop()


def test_untaken_get_segments_expire_with_no_other_get():
    """A reader killed mid-Get leaves the segments it was handed: they go once shm_ttl_s has passed, by the
    server's periodic sweep. They used to wait for the next SHM Get, however long that was."""
    b = Bridge(MemoryStore(1 << 24), shm_ttl_s=0.5)
    try:
        _, call = _raw_shm_get(b, 3)
        handed = [m.frame.shm.name for m in call if m.HasField("frame")]  # read, never taken
        assert handed and all(os.path.exists(shm.SHM_DIR / n) for n in handed)
        assert wait_until(lambda: not any(os.path.exists(shm.SHM_DIR / n) for n in handed), 10.0)
        assert b.client.stats()["server.shm_segments_expired"] >= len(handed)
    finally:
        b.stop()


def test_shm_get_leaves_no_segments_even_for_misses(bridge):
    c = make_chunk("s", dtype=torch.float32, seed=9)
    bridge.client.put([c], transport="shm")
    got = bridge.client.get(["s", "missing", "s"], transport="shm")
    assert len(got) == 1 and same(got[0], c)
    assert shm.list_segments(os.getpid()) == []
    assert bridge.client.stats()["server.shm_segments_sent"] == 1
    # a Put handle naming a missing segment, or a path outside the bridge's segments, is refused
    handles = [pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
        key=k, offset=0, total_length=100, last=True, shm=pb.ShmHandle(name=name, length=100)))
        for k, name in (("m", "fpkv-0-missing"), ("p", "../../etc/passwd"))]
    reply = bridge.client.stub.Put(iter(handles), timeout=TIMEOUT_S)
    assert list(reply.refused_keys) == ["m", "p"] and reply.stored == 0


def test_server_restart_with_disk_tier(tmp_path):
    chunks = prompt_chunks(list(range(3 * CHUNK_TOKENS)), fingerprint(), seed=11)
    keys = [c.key for c in chunks]
    b = Bridge(TieredStore(MemoryStore(1 << 24), DiskStore(tmp_path, 1 << 24)))
    try:
        assert b.client.put(chunks).stored == 3
    finally:
        b.stop()
        assert b.store.close(10)  # what a clean stop does: the disk tier is written behind the puts
    b2 = Bridge(TieredStore(MemoryStore(1 << 24), DiskStore(tmp_path, 1 << 24)))
    try:
        assert b2.client.lookup(keys) == 3
        got = b2.client.get(keys)
        assert len(got) == 3 and all(same(a, c) for a, c in zip(got, chunks))
        st = b2.client.stats()
        assert st["store.hits_disk"] == 3 and st["store.disk.entries"] == 3
    finally:
        b2.stop()


def test_remote_store_adapter(bridge):
    rs = RemoteStore(bridge.client)
    c = make_chunk("r")
    assert rs.put(c) and rs.contains("r") and rs.lookup(["r", "x"]) == 1
    assert same(rs.get("r"), c) and rs.get("x") is None


def test_generated_code_has_not_drifted(tmp_path):
    gen = pytest.importorskip("flashpd.kv_bridge.gen_proto")
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a test extra) regenerates the modules")
    fresh = gen.generate(tmp_path / "proto_gen")
    for p in fresh:
        committed = gen.OUT_DIR / p.name
        assert committed.exists(), f"{committed} missing: run python -m flashpd.kv_bridge.gen_proto"
        assert filecmp.cmp(p, committed, shallow=False), (
            f"{committed.name} differs from what proto/kv_bridge.proto generates: "
            "run python -m flashpd.kv_bridge.gen_proto (with the pinned grpcio-tools)")


# ---- the byte path: frame codec, streaming MAC, frame sizes, parallel streams ----------------------

def test_frame_codec_writes_and_reads_what_protobuf_does():
    g = torch.Generator().manual_seed(0)
    for i in range(200):
        key = "".join(chr(int(c)) for c in torch.randint(32, 0x2FF, (int(torch.randint(0, 70, (1,), generator=g)),),
                                                          generator=g))
        data = os.urandom(int(torch.randint(0, 3, (1,), generator=g)) * 150)
        off, total = int(torch.randint(0, 2**40, (1,), generator=g)) * (i % 2), (2**64 - 1) if i == 7 else 5 * i
        version, last = (0, 1, 300, 2**32 - 1)[i % 4], bool(i % 3)
        for cls, decode in ((pb.PutFrame, frame_codec.decode_put_frame), (pb.GetFrame, frame_codec.decode_get_frame)):
            m = cls(version=version, frame=pb.ChunkFrame(key=key, offset=off, total_length=total, data=data, last=last))
            head, tail = frame_codec.frame_envelope(version, key.encode(), off, total, len(data), last)
            assert head + data + tail == m.SerializeToString()
            d = decode(m.SerializeToString())
            f = d.frame
            assert (d.version, f.key, f.offset, f.total_length, bytes(f.data), f.last, f.shm) == \
                (version, key, off, total, data, last, None)
    # a handle (even an empty one), GetDone, merged repeats, a oneof's last member, unknown fields
    d = frame_codec.decode_get_frame(pb.GetFrame(version=1, frame=pb.ChunkFrame(
        key="k", shm=pb.ShmHandle(name="fpkv-a", length=9))).SerializeToString())
    assert d.frame.shm == frame_codec.ShmRef("fpkv-a", 9)
    assert frame_codec.decode_put_frame(pb.PutFrame(frame=pb.ChunkFrame(shm=pb.ShmHandle())).SerializeToString()
                                        ).frame.shm == frame_codec.ShmRef()
    done = pb.GetFrame(version=1, done=pb.GetDone(found=3)).SerializeToString()
    frame = pb.GetFrame(frame=pb.ChunkFrame(key="a", data=b"xy")).SerializeToString()
    last_wins = frame_codec.decode_get_frame(frame + done)
    assert (last_wins.done, last_wins.frame) == (3, None)
    assert frame_codec.decode_get_frame(done + frame).done is None
    a = pb.PutFrame(version=1, frame=pb.ChunkFrame(key="a", offset=5, data=b"xy")).SerializeToString()
    b = pb.PutFrame(frame=pb.ChunkFrame(total_length=9, last=True)).SerializeToString()
    unknown = b"\x38\x05" + b"\x41" + bytes(8) + b"\x4a\x02hi" + b"\x55" + bytes(4) + b"\x0a\x01\x01"
    ref, d = pb.PutFrame.FromString(a + b + unknown), frame_codec.decode_put_frame(a + b + unknown)
    assert (d.version, d.frame.key, d.frame.offset, d.frame.total_length, bytes(d.frame.data), d.frame.last) == \
        (ref.version, ref.frame.key, ref.frame.offset, ref.frame.total_length, ref.frame.data, ref.frame.last)
    # what the protobuf runtime refuses, the codec refuses (and safe() turns into a value, never a raise)
    for garbage in (b"\xff\xff\xff\xff", b"\x12\x05ab", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                    b"\x12\x03\x0a\x01\xff", b"\x00", b"\x08"):
        with pytest.raises(Exception):
            pb.PutFrame.FromString(garbage)
        with pytest.raises(frame_codec.DecodeError):
            frame_codec.decode_put_frame(garbage)
        bad = frame_codec.safe(frame_codec.decode_put_frame, frame_codec.PUT_FRAME)(garbage)
        assert isinstance(bad, frame_codec.Undecodable) and bad.type_name == frame_codec.PUT_FRAME
    with pytest.raises(frame_codec.DecodeError, match="wire type 3"):  # groups: the one documented difference
        frame_codec.decode_put_frame(b"\x12\x02\x0b\x0c")


def test_streaming_mac_is_the_chunk_mac_however_the_bytes_are_cut():
    data = make_chunk("m", dtype=torch.float32, seed=4).to_bytes(MAC)
    body_mac = MAC.tag([data[:-MAC_BYTES]])
    for frame in (1, 7, MAC_BYTES, 1000, len(data) - 10, len(data), len(data) + 1):
        sm = StreamingMac(MAC, len(data))
        for _, pieces, _ in frame_pieces([data[:100], data[100:]], frame):
            for p in pieces:
                sm.update(p)
        assert sm.body_done and sm.digest() == body_mac
    verify_bytes(data, MAC, key="m", body_mac=body_mac)
    with pytest.raises(CorruptChunk, match="MAC"):  # a digest of other bytes never passes
        verify_bytes(data, MAC, key="m", body_mac=MAC.tag([b"other"]))
    with pytest.raises(CorruptChunk, match="key"):  # every other check still runs
        verify_bytes(data, MAC, key="n", body_mac=body_mac)


def test_assembler_copies_each_frame_once_into_its_own_buffer():
    data = make_chunk("a", dtype=torch.float32, seed=2).to_bytes(MAC)
    for writable in (True, False):
        asm = Assembler(len(data), writable=writable, mac=MAC)
        out = [asm.feed(f) for f in split_frames("a", data, MIN_FRAME_BYTES)]
        assert out[:-1] == [None] * (len(out) - 1) and asm.in_flight is None and asm.parts == []
        done = out[-1]
        assert done.key == "a" and bytes(done.data) == data and done.body_mac == MAC.tag([data[:-MAC_BYTES]])
        assert isinstance(done.data, bytes) != writable and memoryview(done.data).readonly != writable
    frames = list(split_frames("a", data, MIN_FRAME_BYTES))
    asm = Assembler(len(data), writable=True)
    asm.feed(frames[0])
    with pytest.raises(ValueError, match="frame.offset"):
        asm.feed(frames[2])


@pytest.mark.parametrize("frame", [MIN_FRAME_BYTES, 5000, "tag", 1 << 20])
def test_frame_sizes_round_trip_byte_exact(frame):
    chunks = [make_chunk(f"f{i}", dtype=torch.float32, seed=i) for i in range(3)]
    total = len(chunks[0].to_bytes(MAC))
    frame_bytes = total - MAC_BYTES // 2 if frame == "tag" else frame  # "tag": the MAC straddles two frames
    b = Bridge(MemoryStore(1 << 24))
    try:
        with BridgeClient(b.address, TIMEOUT_S, frame_bytes=frame_bytes, streams=2) as cl:
            assert cl.put(chunks).stored == 3
            got = cl.get([c.key for c in chunks])
        assert len(got) == 3 and all(same(a, c) for a, c in zip(got, chunks))
        per_chunk = -(-total // cl.frame_bytes)
        st = b.client.stats()
        assert st["server.frames_received"] == st["server.frames_sent"] == 3 * per_chunk
        assert st["store.corrupt_refused"] == 0
    finally:
        b.stop()


def test_protobuf_clients_still_read_and_write_the_byte_path(bridge):
    """The hand-made messages are plain protobuf: a client built on the generated stub alone works."""
    c = make_chunk("pb", dtype=torch.float32, seed=6)
    data = c.to_bytes(MAC)
    assert bridge.client.stub.Put(iter(frames_of("pb", data)), timeout=TIMEOUT_S).stored == 1
    msgs = list(bridge.client.stub.Get(pb.GetRequest(version=PROTOCOL_VERSION, keys=["pb"], frame_bytes=FRAME),
                                       timeout=TIMEOUT_S))
    assert msgs[-1].done.found == 1 and all(m.version == PROTOCOL_VERSION for m in msgs)
    assert b"".join(m.frame.data for m in msgs[:-1]) == data
    assert [m.frame.offset for m in msgs[:-1]] == list(range(0, len(data), FRAME))


class ByteFaults:
    """A MemoryStore whose reads of some keys fail (raise) or return corrupted bytes."""

    def __init__(self, inner: MemoryStore, fail: set[str] = frozenset(), corrupt: set[str] = frozenset()) -> None:
        self.inner, self.fail, self.corrupt = inner, fail, corrupt
        self.secret = inner.secret

    def get_bytes(self, key):
        if key in self.fail:
            raise RuntimeError("disk on fire")
        data = self.inner.get_bytes(key)
        return flip_byte(data, len(data) // 2) if key in self.corrupt and data is not None else data

    def __getattr__(self, name):
        return getattr(self.inner, name)


def keys5(chunks) -> list[str]:
    return [c.key for c in chunks[:5]]


def get_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvbridge-")]


@pytest.mark.parametrize("streams", [2, 3, 4])
@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_parallel_streams_keep_order_and_stop_at_the_first_miss(bridge, streams, transport):
    chunks = [make_chunk(f"p{i}", seed=i) for i in range(10)]
    with BridgeClient(bridge.address, TIMEOUT_S, frame_bytes=FRAME, streams=streams) as cl:
        s = cl.put(chunks[:6] + chunks[7:], transport=transport)  # p6 is missing
        assert (s.stored, s.ok) == (9, True)
        keys = [c.key for c in chunks]
        got = cl.get(keys, transport=transport)
        assert [c.key for c in got] == keys[:6] and all(same(a, b) for a, b in zip(got, chunks))
        got = cl.get(keys[7:] + ["nope"] + keys[:3], transport=transport)
        assert [c.key for c in got] == keys[7:]
        assert cl.get(["nope"] + keys, transport=transport) == []
        it = cl.iter_get(keys[:6], transport=transport)  # closed early: every stream stops, nothing left behind
        assert same(next(it), chunks[0])
        it.close()
    assert shm.list_segments(os.getpid()) == [] and get_threads() == []
    st = bridge.client.stats()
    assert st["server.chunks_sent"] <= 6 + 3 + 6 + 6  # nothing past a miss (a Lookup bounds the streams)


@pytest.mark.parametrize("transport", ["inline", "shm"])
@pytest.mark.parametrize("fault", ["fail", "corrupt"])
def test_a_stream_failing_midway_fails_the_whole_get(transport, fault):
    chunks = [make_chunk(f"q{i}", seed=i) for i in range(8)]
    store = ByteFaults(MemoryStore(1 << 24), **{fault: {"q5"}})
    b = Bridge(store)
    try:
        with BridgeClient(b.address, TIMEOUT_S, frame_bytes=FRAME, streams=3) as cl:
            cl.put(chunks)
            expected = BridgeProtocolError if fault == "corrupt" else BridgeError
            with pytest.raises(expected, match="Get") as e:
                cl.get([c.key for c in chunks], transport=transport)
            if fault == "corrupt":
                assert "failed verification" in str(e.value)
            seen = []
            with pytest.raises(expected):
                for c in cl.iter_get([c.key for c in chunks], transport=transport):
                    seen.append(c.key)
            # in order, up to the chunk that failed (over SHM maybe fewer: a server whose stream fails
            # reclaims the segments it made for that stream, taken or not)
            assert seen == [c.key for c in chunks[:len(seen)]]
            assert len(seen) == 5 or transport == "shm"
            assert [c.key for c in cl.get([c.key for c in chunks[:5]], transport=transport)] == keys5(chunks)
        assert shm.list_segments(os.getpid()) == [] and get_threads() == []
        assert b.client.health()["serving"]
    finally:
        b.stop()


def test_parallel_put_merges_the_streams_replies_in_key_order(bridge):
    good = [make_chunk(f"g{i}", seed=i) for i in range(5)]
    items = [(c.key, c.to_bytes(MAC)) for c in good]
    items.insert(1, ("bad1", flip_byte(items[0][1], 100)))
    items.insert(4, ("bad2", flip_byte(items[2][1], 200)))
    with BridgeClient(bridge.address, TIMEOUT_S, frame_bytes=FRAME, streams=4) as cl:
        s = cl.put_bytes(items)
        assert (s.stored, s.duplicates, s.refused_keys, s.incomplete_keys) == (5, 0, ["bad1", "bad2"], [])
        again = cl.put(good)
        assert (again.stored, again.duplicates) == (0, 5)
    assert get_threads() == []


def test_a_parallel_put_whose_stream_fails_raises_and_leaves_no_segment(bridge):
    good = [make_chunk(f"h{i}", seed=i) for i in range(4)]
    bad = make_chunk("hx", seed=9)
    bad.target_kv = bad.target_kv.to(torch.int32)  # cannot be serialized: that stream's generator raises
    with BridgeClient(bridge.address, TIMEOUT_S, frame_bytes=FRAME, streams=2) as cl:
        for transport in ("inline", "shm"):
            with pytest.raises(BridgeError, match="Put"):
                cl.put(good[:3] + [bad], transport=transport)
    assert shm.list_segments(os.getpid()) == [] and get_threads() == []
    assert bridge.client.health()["serving"]


def test_streams_are_bounded():
    with pytest.raises(ValueError, match="streams"):
        BridgeClient("127.0.0.1:1", streams=0)


class RecordingStore(MemoryStore):
    """Records what the bridge hands put_bytes: the buffer's type and whether it came verified."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.calls: dict[str, tuple[type, bool, bool]] = {}

    def put_bytes(self, key, data, verified=False):
        self.calls[key] = (type(data), memoryview(data).readonly, verified)
        return super().put_bytes(key, data, verified)


def test_the_bridge_hashes_a_put_once_as_it_arrives_and_the_store_trusts_it():
    store = RecordingStore(1 << 24)
    b = Bridge(store)
    try:
        good = make_chunk("good", seed=1).to_bytes(MAC)
        s = b.client.put_bytes([("good", good), ("bad", flip_byte(good, 300)), ("lying", good)])
        assert (s.stored, sorted(s.refused_keys)) == (1, ["bad", "lying"])
        # verified by the server (the digest taken frame by frame): the store skips its own pass; the rest
        # reach it unverified and it refuses and counts them as always
        assert store.calls == {"good": (memoryview, True, True), "bad": (memoryview, True, False),
                               "lying": (memoryview, True, False)}
        assert store.stats()["corrupt_refused"] == 2 and same(b.client.get(["good"])[0], make_chunk("good", seed=1))
    finally:
        b.stop()


def test_remote_store_put_many(bridge):
    rs = RemoteStore(bridge.client)
    chunks = [make_chunk(f"m{i}", seed=i) for i in range(6)]
    assert rs.put_many(chunks[:4]) == 4 and rs.put_many(chunks) == 6
    assert [c.key for c in rs.get_many([c.key for c in chunks])] == [c.key for c in chunks]


def test_a_publishs_deadline_is_the_clients_timeout_plus_its_bytes_at_a_floor_rate(bridge, monkeypatch):
    """One call for a prompt's chunks: a hung bridge fails it about as soon as one chunk's call did, and a long
    prompt still gets the time its bytes need (not the client's timeout a chunk: 64 chunks would wait 640 s)."""
    from flashpd.kv_bridge import client as client_mod
    seen = []
    real = bridge.client.put
    monkeypatch.setattr(bridge.client, "put", lambda cs, tr="inline", timeout_s=None: (
        seen.append(timeout_s), real(cs, tr, timeout_s))[1])
    chunks = [make_chunk(f"d{i}", seed=i) for i in range(5)]
    assert RemoteStore(bridge.client).put_many(chunks) == 5
    nbytes = sum(c.nbytes() for c in chunks)
    assert seen == [pytest.approx(bridge.client.timeout_s + nbytes / client_mod.PUBLISH_FLOOR_BYTES_PER_S)]


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm on this machine")
def test_a_shm_put_that_times_out_while_a_segment_is_written_leaves_no_segment(bridge, monkeypatch):
    """gRPC reads the request stream on a thread of its own: a segment it is still writing when the call's
    deadline passes was written after the client's cleanup, and its name never reached the server."""
    from flashpd.kv_bridge.shm_pool import SegmentPool

    real, written, finished = SegmentPool.write, [], []

    def slow_second(pool, data, tag=""):  # the second chunk is written while the deadline passes (a large chunk)
        written.append(tag)
        try:
            if len(written) == 2:
                time.sleep(1.0)
            return real(pool, data, tag)
        finally:
            finished.append(tag)

    monkeypatch.setattr(SegmentPool, "write", slow_second)
    before = set(shm.list_segments(os.getpid()))
    with pytest.raises(BridgeTimeout, match="Put"):
        bridge.client.put([make_chunk("t0", seed=0), make_chunk("t1", seed=1)], transport="shm", timeout_s=0.3)
    assert len(written) == 2
    assert wait_until(lambda: len(finished) == 2, 10.0)  # the request thread wrote the second segment
    assert wait_until(lambda: set(shm.list_segments(os.getpid())) - before == set(), 10.0)
    assert bridge.client.health()["serving"]

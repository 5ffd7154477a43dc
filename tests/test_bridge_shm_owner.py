"""A Put's shared-memory segment is its writer's alone to hand to the bridge (real gRPC server on 127.0.0.1, real
files in /dev/shm).

Every client holds the cluster's token and /dev/shm lists every segment's name, so a client that names another
client's in-flight Put segment must not make the bridge take (read and unlink) it: the victim's Put would then be
refused. A Put segment's name carries its writer's owner id (shm.SegmentOwner), and a Put presents the owner key in
its metadata; a handle whose name does not carry the caller's id is refused, counted, and the file never touched.
"""
from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashpd.kv_bridge import shm
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb
from flashpd.kv_bridge.server import REFUSAL_HEADER
from flashpd.kv_bridge.shm_pool import SegmentPool
from flashpd.kv_bridge.wire import PROTOCOL_VERSION, split_frames

from tests._kv_bridge_helpers import BridgeHarness, make_chunk, same

TIMEOUT_S = 10.0

needs_shm = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm on this machine")


@pytest.fixture
def bridge():
    b = BridgeHarness(timeout_s=TIMEOUT_S, max_workers=4)
    yield b
    b.stop()


def handle(key: str, name: str, length: int) -> pb.PutFrame:
    return pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
        key=key, offset=0, total_length=length, last=True, shm=pb.ShmHandle(name=name, length=length)))


def inline(key: str, data: bytes) -> list[pb.PutFrame]:
    return [pb.PutFrame(version=PROTOCOL_VERSION, frame=f) for f in split_frames(key, data, 4096)]


@needs_shm
def test_a_client_cannot_make_the_bridge_take_another_clients_put_segment(bridge, monkeypatch):
    """The victim (a real BridgeClient) has written its segment and not yet sent the handle; an attacker with the
    token names that segment (its own owner key, or none). Each handle is refused without the file being read or
    unlinked, the attacker's stream goes on, and the victim's Put then stores its chunk."""
    victim = make_chunk("victim", seed=1)
    data = victim.to_bytes(bridge.secret.mac_key)
    real_write = SegmentPool.write
    names: list[str] = []
    written, release = threading.Event(), threading.Event()

    def write_then_wait(pool, parts, tag=""):  # the victim's segment exists; its handle is not sent until release
        name = real_write(pool, parts, tag)
        names.append(name)
        written.set()
        release.wait(TIMEOUT_S)
        return name

    monkeypatch.setattr(SegmentPool, "write", write_then_wait)
    with ThreadPoolExecutor(1) as pool:
        victim_put = pool.submit(bridge.client.put, [victim], "shm")
        try:
            assert written.wait(TIMEOUT_S)
            (name,) = names
            path = shm.SHM_DIR / name
            assert name in shm.list_segments() and path.read_bytes() == data  # what a lister sees
            before = os.stat(path)
            other = make_chunk("other", seed=2)
            attacker = shm.SegmentOwner.generate()  # what another BridgeClient presents
            reply, call = bridge.raw.Put.with_call(
                iter([handle("victim", name, len(data)), *inline("other", other.to_bytes(bridge.secret.mac_key))]),
                timeout=TIMEOUT_S, metadata=bridge.md(owner=attacker))
            assert (reply.stored, reply.refused, list(reply.refused_keys)) == (1, 1, ["victim"])  # the stream goes on
            assert "not a segment written by this client" in dict(call.trailing_metadata())[REFUSAL_HEADER]
            reply = bridge.raw.Put(iter([handle("victim", name, len(data))]), timeout=TIMEOUT_S,
                                   metadata=bridge.md())  # no owner key at all
            assert (reply.stored, list(reply.refused_keys)) == (0, ["victim"])
            after = os.stat(path)  # the same file, never unlinked nor replaced; its bytes unchanged
            assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
            assert path.read_bytes() == data
        finally:
            release.set()
        summary = victim_put.result(timeout=TIMEOUT_S)
    assert summary.ok and summary.stored == 1
    assert not (shm.SHM_DIR / name).exists()  # taken by the bridge for its writer
    (got,) = bridge.client.get(["victim"])
    assert same(got, victim)
    c = bridge.client.stats()
    assert c["server.shm_put_segments_not_owned"] == 2 and c["server.invalid_requests"] == 2
    assert c["server.chunks_refused_corrupt"] == 2 and c["server.shm_put_segments_left"] == 0  # never noted


@needs_shm
def test_the_owner_check_is_made_on_the_name_before_the_file_is_opened(bridge):
    """A name that is not the caller's is refused even when it names a FIFO (an open would block) or the right file
    under a forged owner id; only the owner's own Put takes its segment."""
    owner, attacker = shm.SegmentOwner.generate(), shm.SegmentOwner.generate()
    data = make_chunk("s", seed=3).to_bytes(bridge.secret.mac_key)
    fifo = f"{shm.PREFIX}{os.getpid()}-{owner.put_tag}{uuid.uuid4().hex}"
    os.mkfifo(shm.SHM_DIR / fifo)
    name = shm.write_segment(data, owner.put_tag)
    forged = name.replace(owner.put_tag, attacker.put_tag)  # the attacker's id, the victim's file: no such file
    try:
        for n in (fifo, name):
            reply = bridge.raw.Put(iter([handle("s", n, len(data))]), timeout=TIMEOUT_S,
                                   metadata=bridge.md(owner=attacker))
            assert list(reply.refused_keys) == ["s"]
            assert os.path.lexists(shm.SHM_DIR / n)
        reply = bridge.raw.Put(iter([handle("s", forged, len(data))]), timeout=TIMEOUT_S,
                               metadata=bridge.md(owner=attacker))  # its own id, a file that does not exist
        assert list(reply.refused_keys) == ["s"] and os.path.exists(shm.SHM_DIR / name)
        reply = bridge.raw.Put(iter([handle("s", name, len(data))]), timeout=TIMEOUT_S, metadata=bridge.md(owner=owner))
        assert reply.stored == 1 and not os.path.exists(shm.SHM_DIR / name)
        assert bridge.client.stats()["server.shm_put_segments_not_owned"] == 2
    finally:
        for n in (fifo, name):
            if os.path.lexists(shm.SHM_DIR / n):
                os.unlink(shm.SHM_DIR / n)


def test_segment_owner_ids_bind_names_to_a_key_that_is_never_in_them():
    a, b = shm.SegmentOwner.generate(), shm.SegmentOwner.generate()
    name = f"{shm.PREFIX}{os.getpid()}-{a.put_tag}{uuid.uuid4().hex}"
    key_hex = a.metadata()[1]
    assert a.owns(name) and not b.owns(name) and key_hex not in name and key_hex not in repr(a)
    assert shm.put_writer(name) == os.getpid()
    assert shm.SegmentOwner.from_metadata([a.metadata()]).owns(name)
    as_bytes = [("x-flashpd-token", "t"), (shm.SHM_OWNER_HEADER, key_hex.encode())]
    assert shm.SegmentOwner.from_metadata(as_bytes).owns(name)
    for bad in ([], None, [(shm.SHM_OWNER_HEADER, "zz")], [(shm.SHM_OWNER_HEADER, key_hex[:-2])]):
        assert shm.SegmentOwner.from_metadata(bad) is None
    for other in (name + "\n", name.replace(shm.PUT_TAG, shm.GET_TAG), f"{shm.PREFIX}{os.getpid()}-{shm.PUT_TAG}x"):
        assert not a.owns(other)


@needs_shm
def test_a_client_naming_many_segments_not_its_own_cannot_flood_the_log(bridge, caplog):
    """Each refusal is counted, but a stream of them logs one warning, not one a chunk."""
    owner, attacker = shm.SegmentOwner.generate(), shm.SegmentOwner.generate()
    names = [f"{shm.PREFIX}{os.getpid()}-{owner.put_tag}{uuid.uuid4().hex}" for _ in range(50)]
    with caplog.at_level("WARNING", logger="flashpd.kv_bridge.server"):
        reply = bridge.raw.Put(iter([handle(f"k{i}", n, 100) for i, n in enumerate(names)]), timeout=TIMEOUT_S,
                               metadata=bridge.md(owner=attacker))
    assert reply.refused == 50
    assert bridge.client.stats()["server.shm_put_segments_not_owned"] == 50
    warned = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]

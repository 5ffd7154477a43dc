"""The tiered store's write-behind disk tier: a put returns before the disk write, a queued key reads back and
counts as present, a full queue drops disk copies (counted), a failed write is counted and the writer goes on,
close flushes, and a reopened disk tier finds (and still verifies) exactly the bytes that were put."""
from __future__ import annotations

import logging
import os
import shutil
import threading

import pytest

from flashpd.cluster.config import ServeConfig
from flashpd.kv_bridge.disk import DiskStore, TieredStore
from flashpd.kv_bridge.store import MemoryStore, PutResult

try:
    from tests._kv_bridge_helpers import MAC, disk_listing, flip_byte, make_chunk, same
except ImportError:
    from _kv_bridge_helpers import MAC, disk_listing, flip_byte, make_chunk, same  # type: ignore

WAIT_S = 10.0  # bound on every wait here: a broken writer fails the test instead of hanging it


class GatedDisk(DiskStore):
    """A real DiskStore whose writes wait until the test opens the gate: a disk as slow as the test wants."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.entered = threading.Event()  # the writer is inside a write

    def put_bytes(self, key: str, data: bytes, verified: bool = False) -> PutResult:
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        return super().put_bytes(key, data, verified)


def _size() -> int:
    return len(make_chunk("x").to_bytes(MAC))


def test_put_returns_before_the_disk_write_and_pending_keys_read_back(tmp_path):
    n = _size()
    disk = GatedDisk(tmp_path, 1 << 24)
    store = TieredStore(MemoryStore(n + n // 2), disk)  # memory holds one entry
    a, b = make_chunk("a", seed=1), make_chunk("b", seed=2)
    assert store.put_bytes("a", a.to_bytes(MAC)) is PutResult.STORED  # unverified: verified once, here
    assert disk.entered.wait(WAIT_S)  # the writer holds a, blocked on the disk ...
    assert store.put(b)  # ... and puts still return: b evicts a from memory while both are queued
    assert disk_listing(tmp_path) == [] and not disk.contains("a")
    assert not store.memory.contains("a") and store.contains("a") and store.lookup(["a", "b", "z"]) == 2
    s = store.stats()
    assert (s["disk_pending_entries"], s["disk_pending_bytes"], s["disk_queued"]) == (2, 2 * n, 2)
    assert s["disk_written"] == 0
    # a queued key reads back from the queue (exact bytes), and is promoted into memory
    assert store.get_bytes("a") == a.to_bytes(MAC)
    assert store.memory.contains("a") and not store.memory.contains("b")
    assert same(store.get("b"), b)  # b from the queue in turn (a leaves memory again)
    s = store.stats()
    assert (s["hits_pending"], s["hits_disk"], s["misses"]) == (2, 2, 0)
    assert store.put_bytes("b", b.to_bytes(MAC)) is PutResult.PRESENT  # in memory: first writer wins
    store.memory.remove("b")
    assert store.put_bytes("b", b.to_bytes(MAC)) is PutResult.PRESENT  # queued only: still a duplicate
    assert store.stats()["disk_queued"] == 2  # and not queued twice

    disk.gate.set()
    assert store.flush(WAIT_S)
    s = store.stats()
    assert (s["disk_pending_entries"], s["disk_pending_bytes"], s["disk_written"]) == (0, 0, 2)
    assert sorted(disk_listing(tmp_path)) == ["a", "b"]
    assert (tmp_path / "a").read_bytes() == a.to_bytes(MAC) and (tmp_path / "b").read_bytes() == b.to_bytes(MAC)
    # out of memory and out of the queue: read from disk
    store.memory.remove("a"), store.memory.remove("b")
    assert store.get_bytes("a") == a.to_bytes(MAC) and same(store.get("b"), b)
    s = store.stats()
    assert (s["hits_pending"], s["hits_disk"], s["misses"]) == (2, 4, 0)
    assert s["disk"]["hits"] == 2
    store.close(WAIT_S)


def test_full_queue_drops_the_disk_copy_counted_and_keeps_memory(tmp_path, caplog):
    n = _size()
    disk = GatedDisk(tmp_path, 1 << 24)
    store = TieredStore(MemoryStore(1 << 24), disk, queue_bytes=1)  # smaller than one entry
    chunks = [make_chunk(k, seed=i) for i, k in enumerate("abc")]
    assert store.put(chunks[0])  # an empty queue still takes one entry larger than its bound
    assert disk.entered.wait(WAIT_S)
    with caplog.at_level(logging.WARNING, logger="flashpd.kv_bridge.disk"):
        results = [store.put_bytes(c.key, c.to_bytes(MAC), verified=True) for c in chunks[1:]]
    assert results == [PutResult.STORED, PutResult.STORED]  # held in memory: stored, not refused
    s = store.stats()
    assert (s["disk_dropped"], s["disk_queued"], s["disk_pending_bytes"]) == (2, 1, n)
    assert "write queue full" in caplog.text
    assert store.lookup(["a", "b", "c"]) == 3
    disk.gate.set()
    assert store.flush(WAIT_S)
    assert sorted(disk_listing(tmp_path)) == ["a"]
    assert same(store.get("b"), chunks[1])  # the memory copy was kept
    # a later put of a key held in memory only queues its disk copy again (and is a duplicate)
    assert store.put_bytes("b", chunks[1].to_bytes(MAC)) is PutResult.PRESENT
    assert store.flush(WAIT_S) and sorted(disk_listing(tmp_path)) == ["a", "b"]
    # neither tier takes it: memory too small and its disk copy dropped
    tiny = TieredStore(MemoryStore(n // 2), GatedDisk(tmp_path / "t", 1 << 24), queue_bytes=1)
    assert tiny.put(chunks[0])  # queued
    assert tiny.disk.entered.wait(WAIT_S)
    assert tiny.put_bytes("b", chunks[1].to_bytes(MAC)) is PutResult.REFUSED
    tiny.disk.gate.set()
    assert tiny.close(WAIT_S) and store.close(WAIT_S)


class FlakyDisk(DiskStore):
    """A real DiskStore that fails in a way no OSError handler catches, for one key."""

    def put_bytes(self, key: str, data: bytes, verified: bool = False) -> PutResult:
        if key == "boom":
            raise RuntimeError("controller reset")
        return super().put_bytes(key, data, verified)


def test_disk_write_errors_are_counted_and_the_writer_survives(tmp_path, caplog):
    d = tmp_path / "d"
    store = TieredStore(MemoryStore(1 << 24), FlakyDisk(d, 1 << 24))
    c1, c2, c3 = make_chunk("c1", seed=1), make_chunk("boom", seed=2), make_chunk("c3", seed=3)
    shutil.rmtree(d)  # a real failure: the directory is gone (open fails with ENOENT)
    with caplog.at_level(logging.WARNING, logger="flashpd.kv_bridge.disk"):
        assert store.put(c1)
        assert store.flush(WAIT_S)
        assert store.put(c2) and store.flush(WAIT_S)
    s = store.stats()
    assert s["disk_write_errors"] == 2 and s["disk"]["write_errors"] == 1 and s["disk_written"] == 0
    assert "writing c1" in caplog.text and "controller reset" in caplog.text
    assert same(store.get("c1"), c1) and same(store.get("boom"), c2)  # memory kept both
    d.mkdir()
    assert store.put(c3) and store.flush(WAIT_S)  # the same writer (or a fresh one) goes on
    assert disk_listing(d) == ["c3"] and store.stats()["disk_written"] == 1
    assert store.close(WAIT_S)


def test_close_flushes_and_a_reopened_disk_finds_the_exact_bytes(tmp_path):
    chunks = [make_chunk(f"k{i}", seed=i) for i in range(4)]
    store = TieredStore(MemoryStore(1 << 24), DiskStore(tmp_path, 1 << 24))
    for c in chunks:
        assert store.put(c)
    assert store.close(WAIT_S)
    assert store.stats()["disk_written"] == 4
    # after close a put writes its disk copy at once
    late = make_chunk("late", seed=9)
    assert store.put_bytes("late", late.to_bytes(MAC)) is PutResult.STORED and store.disk.contains("late")
    again = TieredStore(MemoryStore(1 << 24), DiskStore(tmp_path, 1 << 24))
    assert again.lookup([c.key for c in chunks] + ["late"]) == 5
    for c in [*chunks, late]:
        assert again.get_bytes(c.key) == c.to_bytes(MAC)
    assert again.stats()["hits_disk"] == 5
    # the reopened disk tier still verifies each entry it reads
    data = (tmp_path / "k0").read_bytes()
    (tmp_path / "k0").write_bytes(flip_byte(data, len(data) // 2))
    cold = TieredStore(MemoryStore(1 << 24), DiskStore(tmp_path, 1 << 24))
    assert cold.get("k0") is None and cold.stats()["disk"]["corrupt_dropped"] == 1


def test_close_with_a_stuck_disk_is_bounded_and_counts_what_it_dropped(tmp_path):
    disk = GatedDisk(tmp_path, 1 << 24)
    store = TieredStore(MemoryStore(1 << 24), disk)
    for k in "abc":
        store.put(make_chunk(k))
    assert disk.entered.wait(WAIT_S)
    closer = threading.Thread(target=lambda: store.close(0.2))
    closer.start()
    closer.join(WAIT_S / 2)  # returns while a's write is still stuck
    s = store.stats()
    assert not closer.is_alive() and s["disk_dropped"] == 2 and s["disk_pending_entries"] == 1
    disk.gate.set()
    assert store.flush(WAIT_S) and disk_listing(tmp_path) == ["a"]


def test_config_bounds_the_queue():
    assert ServeConfig(target="t").bridge_disk_queue_bytes == 512 << 20
    with pytest.raises(ValueError, match="bridge_disk_queue_bytes"):
        ServeConfig(target="t", bridge_disk_queue_bytes=0)

"""The Put segment pool (kv_bridge/shm_pool.py): real unnamed tmpfs files, a real bridge on 127.0.0.1.

A pooled write must give the bridge exactly what a fresh segment would (the bytes, the length, the owner's name,
a regular file of this user), hold no named file while it waits, free its files when closed or idle, and fall
back to fresh segments, loudly, where the host cannot pool."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from flashpd.kv_bridge import shm, shm_pool
from flashpd.kv_bridge.shm_pool import SegmentPool

from tests._kv_bridge_helpers import BridgeHarness, make_chunk, same

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm on this machine")
OWNER = shm.SegmentOwner.generate()


def wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def filled(pool: SegmentPool, size: int) -> None:
    """Ask for files of `size` (a first write) and wait until the pool holds as many as it keeps."""
    name = pool.write([b"x" * size], OWNER.put_tag)
    shm.unlink_segment(name)
    wait_for(lambda: pool.stats["files_made"] >= shm_pool.MAX_FILES)


def test_a_pooled_write_is_a_segment_with_exactly_the_chunks_bytes():
    pool = SegmentPool(64 << 20)
    try:
        filled(pool, 100_000)
        assert pool.held_bytes() == shm_pool.MAX_FILES * shm_pool.ROUND
        parts = [b"head", memoryview(os.urandom(300_000)), b"", bytearray(b"tail")]
        data = b"".join(bytes(p) for p in parts)
        name = pool.write(parts, OWNER.put_tag)
        assert pool.stats["pooled_writes"] == 1  # the first write found none ready; this one did
        assert OWNER.owns(name) and shm.put_writer(name) == os.getpid()
        st = os.lstat(shm.SHM_DIR / name)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == len(data)  # the pool file's 2 MiB cut to the chunk
        assert shm.take_segment(name, len(data)) == data
        assert name not in shm.list_segments()
        # a chunk larger than the files held is written whole (the file grows)
        big = os.urandom(3 * shm_pool.ROUND + 5)
        name = pool.write([big], OWNER.put_tag)
        assert pool.stats["pooled_writes"] == 2 and shm.take_segment(name, len(big)) == big
    finally:
        pool.close()


def test_held_files_have_no_names_and_close_frees_them():
    before = set(shm.list_segments(os.getpid()))
    pool = SegmentPool(64 << 20)
    filled(pool, 1000)
    assert pool.held_bytes() > 0
    assert set(shm.list_segments(os.getpid())) == before  # nothing in /dev/shm for anyone to name or leak
    pool.close()
    assert pool.held_bytes() == 0
    assert pool._thread is None or not pool._thread.is_alive()
    name = pool.write([b"after close"], OWNER.put_tag)  # a closed pool still writes, into a fresh file
    assert shm.take_segment(name, 11) == b"after close" and pool.stats["fresh_writes"] == 2


def test_a_writer_that_dies_holding_pool_files_leaves_no_segment():
    code = ("import os, sys, time; from flashpd.kv_bridge import shm, shm_pool; "
            "o = shm.SegmentOwner.generate(); p = shm_pool.SegmentPool(64 << 20); "
            "shm.unlink_segment(p.write([b'x' * 5000], o.put_tag)); "
            "t = time.monotonic()\n"
            "while p.stats['files_made'] < shm_pool.MAX_FILES and time.monotonic() - t < 10: time.sleep(0.01)\n"
            "print(os.getpid(), p.stats['files_made'], flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid, made = map(int, out.stdout.split())
    assert made == shm_pool.MAX_FILES
    assert shm.list_segments(pid) == []  # died without close(): its files went with its descriptors


def test_an_idle_pool_frees_its_files_and_restarts_on_the_next_write(monkeypatch):
    monkeypatch.setattr(shm_pool, "IDLE_S", 0.3)
    pool = SegmentPool(64 << 20)
    try:
        filled(pool, 1000)
        wait_for(lambda: pool.held_bytes() == 0 and pool._thread is None)
        shm.unlink_segment(pool.write([b"y"], OWNER.put_tag))
        wait_for(lambda: pool.held_bytes() > 0)
    finally:
        pool.close()


def test_a_pool_that_cannot_name_its_files_falls_back_to_fresh_segments_and_says_so(monkeypatch, caplog):
    pool = SegmentPool(64 << 20)
    try:
        filled(pool, 1000)

        def no_link(*a, **k):
            raise OSError(2, "No such file or directory")
        monkeypatch.setattr(shm_pool.os, "link", no_link)
        with caplog.at_level("WARNING", logger="flashpd.kv_bridge.shm_pool"):
            name = pool.write([b"still written"], OWNER.put_tag)
        assert shm.take_segment(name, 13) == b"still written"
        assert pool.disabled is not None and "cannot be filled and named" in caplog.text
        assert pool.held_bytes() == 0
        assert shm.take_segment(pool.write([b"z"], OWNER.put_tag), 1) == b"z"
        assert pool.stats["pooled_writes"] == 0 and pool.stats["fresh_writes"] == 3
    finally:
        pool.close()


def test_no_pool_when_its_bytes_are_zero_or_a_chunk_is_larger_than_it():
    off = SegmentPool(0)
    shm.unlink_segment(off.write([b"a"], OWNER.put_tag))
    assert off.disabled == "off" and off._thread is None
    small = SegmentPool(shm_pool.ROUND)
    try:
        shm.unlink_segment(small.write([b"b" * (shm_pool.ROUND + 1)], OWNER.put_tag))
        assert small._thread is None  # never pooled: no thread, no files
    finally:
        small.close()
    with pytest.raises(ValueError):
        SegmentPool(-1)


def test_a_clients_shm_puts_go_through_its_pool_and_store_the_exact_chunks():
    b = BridgeHarness(timeout_s=10.0, max_workers=4)
    try:
        chunks = [make_chunk(f"p{i}", seed=i) for i in range(12)]
        for c in chunks[:2]:  # the first starts the pool's thread; wait for it to fill
            assert b.client.put([c], "shm").stored == 1
        pool = b.client._shm_pool
        wait_for(lambda: pool.stats["files_made"] >= shm_pool.MAX_FILES)
        assert b.client.put(chunks[2:], "shm").stored == 10
        assert pool.stats["pooled_writes"] >= shm_pool.MAX_FILES
        got = b.client.get([c.key for c in chunks])
        assert len(got) == 12 and all(same(a, g) for a, g in zip(chunks, got))
        assert [s for s in shm.list_segments(os.getpid()) if "put-" in s] == []
    finally:
        b.stop()
    assert b.client._shm_pool.held_bytes() == 0


def test_a_taken_segment_leaves_its_name_at_once_and_its_pages_on_the_reaper():
    data = os.urandom(5 << 20)
    name = shm.write_segment(data, OWNER.put_tag)
    assert shm.take_segment(name, len(data)) == data
    assert not (shm.SHM_DIR / name).exists() and name not in shm.list_segments()  # nobody finds it by name
    shm.drain_reaper()
    assert shm.reap_pending() == 0
    assert not [p for p in os.listdir(shm.SHM_DIR) if p.startswith(f"{shm.GONE_PREFIX}{os.getpid()}-")]


def test_retired_segments_of_a_process_that_died_are_swept_and_a_live_ones_are_not():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    left = shm.SHM_DIR / f"{shm.GONE_PREFIX}{pid}-{'a' * 32}"
    mine = shm.SHM_DIR / f"{shm.GONE_PREFIX}{os.getpid()}-{'b' * 32}"
    left.write_bytes(b"x")
    mine.write_bytes(b"y")
    try:
        assert shm.sweep_retired() >= 1
        assert not left.exists() and mine.exists()
    finally:
        for p in (left, mine):
            p.unlink(missing_ok=True)

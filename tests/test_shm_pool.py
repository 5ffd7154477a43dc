"""The Put segment pool (kv_bridge/shm_pool.py): real unnamed tmpfs files, a real bridge on 127.0.0.1.

A pooled write must give the bridge exactly what a fresh segment would (the bytes, the length, the owner's name,
a regular file of this user), hold no named file while it waits, free its files when closed or idle, and fall
back to fresh segments, loudly, where the host cannot pool."""
from __future__ import annotations

import os
import stat
import threading
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
    for fd, _ in pool._ready:  # unnamed files (O_TMPFILE): the kernel frees them with the process's descriptors
        assert os.readlink(f"/proc/self/fd/{fd}").endswith("(deleted)")
    pool.close()
    assert pool.held_bytes() == 0
    assert pool._thread is None or not pool._thread.is_alive()
    name = pool.write([b"after close"], OWNER.put_tag)  # a closed pool still writes, into a fresh file
    assert shm.take_segment(name, 11) == b"after close" and pool.stats["fresh_writes"] == 2


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
    mine = f"{shm.GONE_PREFIX}{os.getpid()}-"
    gone = lambda: {p for p in os.listdir(shm.SHM_DIR) if p.startswith(mine)}  # noqa: E731
    before = gone()
    assert shm.take_segment(name, len(data)) == data
    assert not (shm.SHM_DIR / name).exists() and name not in shm.list_segments()  # nobody finds it by name
    assert shm.drain_reaper() and shm.reap_pending() == 0
    assert gone() - before == set()


def test_a_sweep_unlinks_every_retired_file_of_this_user_and_nothing_else(tmp_path):
    """A retired file is garbage whoever renamed it (a process that died before its reaper, or one alive whose reaper
    then finds it gone); names that are not a retired file's, and directories, are left; a pid no process can have
    is no error (os.kill raised OverflowError on it)."""
    dead = shm.SHM_DIR / f"{shm.GONE_PREFIX}1234567-{'a' * 32}"
    mine = shm.SHM_DIR / f"{shm.GONE_PREFIX}{os.getpid()}-{'b' * 32}"
    odd = shm.SHM_DIR / f"{shm.GONE_PREFIX}99999999999-{'c' * 32}"  # not a pid: left alone, and no OverflowError
    folder = shm.SHM_DIR / f"{shm.GONE_PREFIX}{os.getpid()}-{'d' * 32}"
    for p in (dead, mine, odd):
        p.write_bytes(b"x")
    folder.mkdir()
    try:
        assert shm.sweep_retired() >= 2
        assert not dead.exists() and not mine.exists() and odd.exists() and folder.is_dir()
        assert not shm.process_exists(99999999999)
    finally:
        for p in (dead, mine, odd):
            p.unlink(missing_ok=True)
        folder.rmdir()


def test_the_pool_never_fills_the_tmpfs_past_half_and_waits_for_room(monkeypatch):
    """A small /dev/shm (a container's 64 MiB) gets no pool files rather than a Put that no longer fits; the pool
    stays on and makes files once there is room again."""
    real = os.statvfs
    room = {"small": True}

    def statvfs(path):
        st = real(path)
        if not room["small"]:
            return st
        blocks = (64 << 20) // st.f_frsize  # 64 MiB, 30 MiB of it free
        return os.statvfs_result((st.f_bsize, st.f_frsize, blocks, (30 << 20) // st.f_frsize,
                                  (30 << 20) // st.f_frsize, st.f_files, st.f_ffree, st.f_favail, st.f_flag,
                                  st.f_namemax))
    monkeypatch.setattr(shm_pool.os, "statvfs", statvfs)
    pool = SegmentPool(64 << 20)
    try:
        shm.unlink_segment(pool.write([b"x" * 100_000], OWNER.put_tag))  # 2 MiB more: 28 of 64 MiB left
        wait_for(lambda: pool._paused)
        assert pool.stats["files_made"] == 0 and pool.disabled is None
        room["small"] = False
        shm.unlink_segment(pool.write([b"x" * 100_000], OWNER.put_tag))  # a write ends the pause
        wait_for(lambda: pool.stats["files_made"] >= shm_pool.MAX_FILES)
        assert pool.stats["fresh_writes"] == 2
    finally:
        pool.close()


def test_waiting_for_taken_segments_bounds_the_bytes_ahead_and_gives_up_on_a_refused_one():
    from flashpd.kv_bridge.client import _wait_taken
    a, b = shm.write_segment(b"a" * 100, OWNER.put_tag), shm.write_segment(b"b" * 100, OWNER.put_tag)
    ahead = [(a, 100), (b, 100)]
    try:
        assert _wait_taken(list(ahead), 100, lambda: False, limit=300)  # fits
        assert not _wait_taken(list(ahead), 100, lambda: True, limit=250)  # does not fit, and the call has ended
        t = threading.Timer(0.2, shm.unlink_segment, (a,))  # the bridge takes the oldest
        t0 = time.monotonic()
        t.start()
        waiting = list(ahead)
        assert _wait_taken(waiting, 100, lambda: False, limit=250, grace_s=60)
        assert 0.15 < time.monotonic() - t0 < 30 and waiting == [(b, 100)]
        c = shm.write_segment(b"c" * 100, OWNER.put_tag)
        shm.unlink_segment(c)  # a later segment taken: b, still there, was refused and counts no more, at once
        waiting = [(b, 100), (c, 100)]
        t0 = time.monotonic()
        assert _wait_taken(waiting, 100, lambda: False, limit=150, grace_s=60) and waiting == []
        assert time.monotonic() - t0 < 30
        t0 = time.monotonic()  # the newest never taken (refused) stops counting after the grace
        assert _wait_taken([(b, 100)], 100, lambda: False, limit=150, grace_s=0.2)
        assert 0.15 < time.monotonic() - t0 < 30
    finally:
        shm.unlink_segment(a)
        shm.unlink_segment(b)


def test_a_put_stream_never_runs_its_segments_far_ahead_of_a_slow_bridge(monkeypatch):
    """A handle is a few bytes, so nothing else stops a writer from putting a whole prompt's segments into tmpfs
    while the bridge is busy storing the first: SHM_AHEAD_BYTES bounds what is written and not yet taken."""
    from flashpd.kv_bridge import client as client_mod
    from flashpd.kv_bridge.store import MemoryStore
    monkeypatch.setattr(client_mod, "AHEAD_GRACE_S", 60.0)  # a starved bridge thread must not count as a refusal

    class SlowStore(MemoryStore):
        def put_bytes(self, key, data, verified=False):
            time.sleep(0.05)
            return super().put_bytes(key, data, verified)

    from flashpd.kv_bridge.auth import ClusterSecret
    secret = ClusterSecret.generate()
    chunks = [make_chunk(f"s{i}", parent=f"s{i - 1}" if i else "", seed=i) for i in range(8)]  # one chain: one stream
    size = len(chunks[0].to_bytes(secret.mac_key))
    monkeypatch.setattr(client_mod, "SHM_AHEAD_BYTES", 2 * size + 1000)
    seen = []
    real = SegmentPool.write

    def counting(pool, parts, tag=""):
        seen.append(len(shm.list_segments(os.getpid(), "put-")))
        return real(pool, parts, tag)
    monkeypatch.setattr(SegmentPool, "write", counting)
    b = BridgeHarness(SlowStore(1 << 28, secret), secret, timeout_s=10.0, max_workers=4)
    try:
        assert b.client.put(chunks, "shm").stored == 8
        got = b.client.get([c.key for c in chunks])
        assert len(got) == 8 and all(same(x, y) for x, y in zip(chunks, got))
    finally:
        b.stop()
    assert len(seen) == 8 and max(seen) <= 1, seen  # at most one other untaken when a segment is written


def test_a_full_tmpfs_or_no_descriptor_pauses_the_pool_it_does_not_turn_it_off(monkeypatch):
    import errno as errno_mod
    pool = SegmentPool(64 << 20)
    fail = {"errno": errno_mod.ENOSPC}
    real = os.posix_fallocate

    def fallocate(fd, off, n):
        if fail["errno"]:
            raise OSError(fail["errno"], os.strerror(fail["errno"]))
        return real(fd, off, n)
    monkeypatch.setattr(shm_pool.os, "posix_fallocate", fallocate)
    try:
        shm.unlink_segment(pool.write([b"x" * 1000], OWNER.put_tag))
        wait_for(lambda: pool._paused)
        fail["errno"] = errno_mod.EMFILE
        shm.unlink_segment(pool.write([b"x" * 1000], OWNER.put_tag))
        wait_for(lambda: pool._paused)
        assert pool.disabled is None and pool.stats["files_made"] == 0
        fail["errno"] = 0
        shm.unlink_segment(pool.write([b"x" * 1000], OWNER.put_tag))
        wait_for(lambda: pool.stats["files_made"] >= 1)
        fail["errno"] = errno_mod.EOPNOTSUPP  # not a "not now": the pool goes off, and says so
        deadline = time.monotonic() + 10
        while pool.disabled is None and time.monotonic() < deadline:  # each write takes a file: a refill is due
            shm.unlink_segment(pool.write([b"x" * 1000], OWNER.put_tag))
            time.sleep(0.05)
        assert "cannot be allocated" in pool.disabled
    finally:
        pool.close()


def test_past_its_backlog_a_take_unlinks_its_segment_itself(monkeypatch):
    monkeypatch.setattr(shm, "MAX_REAP_BACKLOG", 0)
    mine = f"{shm.GONE_PREFIX}{os.getpid()}-"
    before = {p for p in os.listdir(shm.SHM_DIR) if p.startswith(mine)}
    name = shm.write_segment(b"q" * 1000, OWNER.put_tag)
    assert shm.take_segment(name, 1000) == b"q" * 1000
    assert not (shm.SHM_DIR / name).exists() and shm.reap_pending() == 0
    assert {p for p in os.listdir(shm.SHM_DIR) if p.startswith(mine)} - before == set()


def test_a_tmpfs_without_a_size_limit_gets_its_pool(monkeypatch):
    """statvfs says 0 blocks for a tmpfs mounted with size=0 (no limit): that is no reason to pause forever."""
    real = os.statvfs

    def unlimited(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, 0, 0, 0, st.f_files, st.f_ffree, st.f_favail,
                                  st.f_flag, st.f_namemax))
    monkeypatch.setattr(shm_pool.os, "statvfs", unlimited)
    pool = SegmentPool(64 << 20)
    try:
        filled(pool, 1000)
        assert not pool._paused and pool.disabled is None
    finally:
        pool.close()


def test_a_thread_that_cannot_start_costs_one_fresh_write_not_the_pool(monkeypatch):
    real = threading.Thread.start
    fail = {"once": True}

    def start(self):
        if fail["once"] and self.name == "shm-pool":
            fail["once"] = False
            raise RuntimeError("can't start new thread")
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    pool = SegmentPool(64 << 20)
    try:
        assert shm.take_segment(pool.write([b"first"], OWNER.put_tag), 5) == b"first"  # fresh, no thread
        assert pool._thread is None and pool.disabled is None
        filled(pool, 1000)  # the next write starts one
        assert pool.stats["fresh_writes"] == 2
    finally:
        pool.close()


def test_a_forked_child_drops_the_parents_pool_files_and_reaper_state():
    pool = SegmentPool(64 << 20)
    try:
        filled(pool, 1000)
        name = shm.write_segment(b"r" * 100, OWNER.put_tag)
        shm.take_segment(name, 100)  # something for the parent's reaper
        pid = os.fork()
        if pid == 0:  # the child: only checks, then leaves without running the parent's exit handlers
            ok = (pool._ready == [] and pool._thread is None and shm.reap_pending() == 0
                  and shm._reaper is None)
            os._exit(0 if ok else 1)
        deadline = time.monotonic() + 30  # a child stuck on a lock some other thread held at the fork: fail, not hang
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish within 30 s")
        assert os.waitstatus_to_exitcode(done[1]) == 0
        assert len(pool._ready) == shm_pool.MAX_FILES  # the parent's files untouched
        assert shm.drain_reaper()
    finally:
        pool.close()

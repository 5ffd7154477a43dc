"""The disk tier's directory: one owning process, files of another secret dropped at start, other files untouched.

Found by a review: after a service started again under a new secret, the old files were indexed unverified, so
each blocked the put of its key (PRESENT) until a read dropped it, and a long prompt won its disk hits back one
chunk a cycle; two processes on one directory each kept their own budget (the directory grew to N budgets) and
deleted each other's files; files of an operator's were counted and evicted first.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.disk import DiskStore, DiskTierInUse, TieredStore
from flashpd.kv_bridge.store import MemoryStore

try:
    from tests._kv_bridge_helpers import CHUNK_TOKENS, disk_listing, fingerprint, prompt_chunks
except ImportError:
    from _kv_bridge_helpers import CHUNK_TOKENS, disk_listing, fingerprint, prompt_chunks  # type: ignore


def _tiered(directory: Path, secret: ClusterSecret, memory_bytes: int = 1 << 24) -> TieredStore:
    return TieredStore(MemoryStore(memory_bytes, secret), DiskStore(directory, 1 << 26, secret))


def test_a_start_under_a_new_secret_drops_the_old_files_and_the_next_puts_reach_the_disk(tmp_path):
    """A prompt's six chunks on disk under secret A; the service starts again under B. The start drops A's files
    (they can never verify), the prompt's puts under B all reach the disk, and a third start under B (memory
    empty) hits all six from disk. Before, four of them stayed PRESENT-blocked and missed."""
    a, b = ClusterSecret.generate(), ClusterSecret.generate()
    chunks = prompt_chunks(list(range(6 * CHUNK_TOKENS)), fingerprint(), seed=3)
    keys = [c.key for c in chunks]
    first = _tiered(tmp_path, a)
    assert all(first.put(c) for c in chunks) and first.flush(10)
    first.close()
    assert disk_listing(tmp_path) == sorted(keys)

    second = _tiered(tmp_path, b, memory_bytes=1)  # memory holds nothing: every read is the disk's
    assert second.disk.stats()["other_secret_dropped"] == 6 and second.disk.stats()["entries"] == 0
    assert second.lookup(keys) == 0
    assert all(second.put(c) for c in chunks) and second.flush(10)
    assert second.disk.stats()["puts"] == 6
    second.close()

    third = _tiered(tmp_path, b, memory_bytes=1)
    assert third.disk.stats()["other_secret_dropped"] == 0 and third.lookup(keys) == 6
    assert all(third.get_bytes(k) is not None for k in keys) and third.disk.stats()["corrupt_dropped"] == 0
    third.close()


def test_a_start_under_the_same_secret_keeps_the_files(tmp_path):
    s = ClusterSecret.generate()
    chunks = prompt_chunks(list(range(3 * CHUNK_TOKENS)), fingerprint(), seed=5)
    first = DiskStore(tmp_path, 1 << 24, s)
    assert all(first.put(c) for c in chunks)
    first.close()
    again = DiskStore(tmp_path, 1 << 24, s)
    assert again.stats()["other_secret_dropped"] == 0 and again.lookup([c.key for c in chunks]) == 3
    again.close()


def test_files_without_the_chunk_magic_are_never_counted_nor_deleted(tmp_path):
    """An operator's files under key-like names: not entries, not in the budget, left in place by a start whose
    budget is smaller than the directory and by a start under another secret."""
    s = ClusterSecret.generate()
    chunks = prompt_chunks(list(range(2 * CHUNK_TOKENS)), fingerprint(), seed=7)
    first = DiskStore(tmp_path, 1 << 24, s)
    assert all(first.put(c) for c in chunks)
    first.close()
    theirs = {"notes.txt": b"mine" * 1000, "model.safetensors": b"\0" * 5000, "README": b"hello"}
    for name, data in theirs.items():
        (tmp_path / name).write_bytes(data)
    small = DiskStore(tmp_path, 1, s)  # smaller than one chunk: every entry goes at start
    assert small.stats()["entries"] == 0 and small.stats()["bytes"] == 0
    small.close()
    other = DiskStore(tmp_path, 1 << 24, ClusterSecret.generate())
    assert other.stats()["entries"] == 0
    other.close()
    assert disk_listing(tmp_path) == sorted(theirs)
    assert all((tmp_path / n).read_bytes() == d for n, d in theirs.items())


def _hold_in_child(directory: Path, ready: Path, release: Path) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import time, pathlib
        from flashpd.kv_bridge.disk import DiskStore
        store = DiskStore({str(directory)!r}, 1 << 20)
        pathlib.Path({str(ready)!r}).write_text("held")
        while not pathlib.Path({str(release)!r}).exists():
            time.sleep(0.02)
        store.close()
        print("closed", flush=True)
        time.sleep(30)
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_second_process_cannot_open_a_held_directory_and_can_once_it_is_let_go(tmp_path):
    """One process owns the directory: another gets DiskTierInUse (after its wait) while the first holds it, and
    opens it once the first closed its store (the process itself still alive)."""
    import time

    ready, release = tmp_path / "ready", tmp_path / "release"
    d = tmp_path / "kv"
    child = _hold_in_child(d, ready, release)
    try:
        t0 = time.monotonic()
        while not ready.exists():
            assert child.poll() is None and time.monotonic() - t0 < 60, "the child did not open the store"
            time.sleep(0.02)
        t1 = time.monotonic()
        with pytest.raises(DiskTierInUse, match="another process holds it"):
            DiskStore(d, 1 << 20, owner_wait_s=0.3)
        assert time.monotonic() - t1 >= 0.3
        release.write_text("go")
        assert child.stdout.readline().strip() == "closed"
        mine = DiskStore(d, 1 << 20, owner_wait_s=5)
        mine.close()
    finally:
        release.write_text("go")
        child.kill()
        child.wait(10)


def _child_opens(directory: Path) -> str:
    """What a fresh process gets opening the directory at once: "opened" or "in use"."""
    code = textwrap.dedent(f"""
        from flashpd.kv_bridge.disk import DiskStore, DiskTierInUse
        try:
            DiskStore({str(directory)!r}, 1 << 20, owner_wait_s=0.2).close()
            print("opened")
        except DiskTierInUse:
            print("in use")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip()


def test_one_process_may_open_its_directory_again_and_lets_it_go_with_the_last_store(tmp_path):
    """A restart in place (a second store of this process on the directory) shares the process's lock; the
    directory is let go only when both are closed, in either order, and a store dropped unclosed lets it go too."""
    first = DiskStore(tmp_path, 1 << 20)
    again = DiskStore(tmp_path, 1 << 20, owner_wait_s=0)
    first.close()
    first.close()  # idempotent
    assert _child_opens(tmp_path) == "in use"
    again.close()
    assert _child_opens(tmp_path) == "opened"
    dropped = DiskStore(tmp_path, 1 << 20)
    assert _child_opens(tmp_path) == "in use"
    del dropped  # finalized unclosed: let go at this process's next open or close of any directory
    DiskStore(tmp_path / "other", 1 << 20).close()
    assert _child_opens(tmp_path) == "opened"


def test_the_last_disk_writer_lets_the_directory_go_after_a_close_that_timed_out(tmp_path, monkeypatch):
    """TieredStore.close whose flush timed out leaves its writer finishing the queue; the writer lets the
    directory go as it exits (nothing did, and the directory stayed held while the store lived)."""
    import threading
    import time

    s = ClusterSecret.generate()
    store = _tiered(tmp_path, s)
    gate = threading.Event()
    orig = store.disk.put_bytes

    def slow(key, data, verified=False):
        gate.wait(30)
        return orig(key, data, verified)

    monkeypatch.setattr(store.disk, "put_bytes", slow)
    chunks = prompt_chunks(list(range(2 * CHUNK_TOKENS)), fingerprint(), seed=9)
    assert all(store.put(c) for c in chunks)
    assert not store.close(timeout=0.2)  # the first write is still blocked
    assert _child_opens(tmp_path) == "in use"
    gate.set()
    t0 = time.monotonic()
    while store._thread is not None and time.monotonic() - t0 < 30:
        time.sleep(0.02)
    time.sleep(0.1)
    assert _child_opens(tmp_path) == "opened"


def test_a_read_only_directory_opens_and_keeps_its_files(tmp_path, monkeypatch):
    """A directory this process cannot write (a read-only mount) still opens (the lock is taken on the directory
    itself), and files of another secret are left there, not indexed; the tag is not written."""
    from flashpd.kv_bridge import disk as disk_mod

    s = ClusterSecret.generate()
    chunks = prompt_chunks(list(range(2 * CHUNK_TOKENS)), fingerprint(), seed=11)
    first = DiskStore(tmp_path, 1 << 24, s)
    assert all(first.put(c) for c in chunks)
    first.close()
    monkeypatch.setattr(disk_mod.os, "access", lambda path, mode: mode != disk_mod.os.W_OK)
    ro = DiskStore(tmp_path, 1 << 24, ClusterSecret.generate())
    assert ro.stats()["entries"] == 0 and ro.stats()["other_secret_dropped"] == 2
    assert disk_listing(tmp_path) == sorted(c.key for c in chunks)
    ro.close()
    same = DiskStore(tmp_path, 1 << 24, s)  # the tag still names the first secret
    assert same.lookup([c.key for c in chunks]) == 2
    same.close()

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


def test_one_process_may_open_its_directory_again(tmp_path):
    """A restart in place (a second store of this process on the directory) shares the process's lock; the
    directory is let go only when both are closed."""
    first = DiskStore(tmp_path, 1 << 20)
    again = DiskStore(tmp_path, 1 << 20, owner_wait_s=0)
    first.close()
    first.close()  # idempotent
    again.close()

"""DiskStore races on a key's path (real files in a tmp dir, the interleaving forced with events).

A read that finds a file corrupt (or cannot read it) drops it, but only that very file: between the failed read
and its drop, another reader may drop the same file (or an eviction take it) and a put publish a good file under
the key. A drop by name alone then deleted the good file and its index entry. Each test here pauses the first
reader's drop (the store's own _drop_corrupt, wrapped on the instance) until the good file is in place."""
from __future__ import annotations

import os
import threading

import pytest

from flashpd.kv_bridge.disk import DiskStore
from flashpd.kv_bridge.store import PutResult

try:
    from tests._kv_bridge_helpers import MAC, disk_listing, flip_byte, make_chunk, same
except ImportError:
    from _kv_bridge_helpers import MAC, disk_listing, flip_byte, make_chunk, same  # type: ignore

WAIT_S = 10.0  # bound on every wait: a broken interleaving fails the test instead of hanging it


def _read(store: DiskStore, how: str, key: str):
    return store.get(key) if how == "get" else store.get_bytes(key)


class PausedDrop:
    """Wraps store._drop_corrupt (or another drop, `name`): the first call (the first reader's) signals `found` and
    waits for `go`; later calls (the other reader's) run at once."""

    def __init__(self, store: DiskStore, name: str = "_drop_corrupt") -> None:
        self.original = getattr(store, name)
        self.found = threading.Event()
        self.go = threading.Event()
        self.calls = 0
        self._lock = threading.Lock()
        setattr(store, name, self)  # an instance attribute: only this store, only this test

    def __call__(self, *args, **kwargs):
        with self._lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            self.found.set()
            assert self.go.wait(WAIT_S), "the test never let the first drop go on"
        return self.original(*args, **kwargs)


def _first_reader(store: DiskStore, how: str, key: str) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(_read(store, how, key))
        except BaseException as e:  # noqa: BLE001  reported by the test, not lost in the thread
            out.append(e)

    t = threading.Thread(target=run, name="first-reader", daemon=True)
    t.start()
    return t, out


def _assert_holds_exactly(store: DiskStore, tmp_path, key: str, data: bytes) -> None:
    assert (tmp_path / key).read_bytes() == data, "the good file put since the failed read was deleted"
    assert store.contains(key), "the good entry put since the failed read left the index"
    s = store.stats()
    assert s["bytes"] == sum(os.path.getsize(tmp_path / k) for k in disk_listing(tmp_path))
    assert store.get_bytes(key) == data and same(store.get(key), make_chunk(key, seed=7))


@pytest.mark.parametrize("how", ["get", "get_bytes"])
def test_a_late_corrupt_drop_leaves_a_good_file_put_since(tmp_path, how):
    """Two readers find one corrupt file; the second drops it, a put publishes a good file under the key, and
    only then does the first reader's drop run: the good file and its index entry stay."""
    store = DiskStore(tmp_path, 1 << 24)
    good = make_chunk("k", seed=7).to_bytes(MAC)
    assert store.put_bytes("k", good) is PutResult.STORED
    (tmp_path / "k").write_bytes(flip_byte(good, len(good) - 40))  # rot in place

    pause = PausedDrop(store)
    t, out = _first_reader(store, how, "k")
    assert pause.found.wait(WAIT_S)  # the first reader found the file corrupt, its drop not yet run
    assert _read(store, how, "k") is None  # the second reader: corrupt, dropped at once
    assert not store.contains("k") and not (tmp_path / "k").exists()
    assert store.put_bytes("k", good) is PutResult.STORED  # a good copy comes back (e.g. the write-behind writer)
    pause.go.set()
    t.join(WAIT_S)
    assert not t.is_alive() and out == [None]

    _assert_holds_exactly(store, tmp_path, "k", good)
    s = store.stats()
    assert (s["entries"], s["corrupt_dropped"]) == (1, 2)


def test_a_late_corrupt_drop_leaves_a_good_file_put_after_an_eviction(tmp_path):
    """The corrupt file leaves by eviction instead (room for other puts), then a good copy comes back under the
    key: the first reader's late drop leaves it."""
    n = len(make_chunk("x").to_bytes(MAC))
    store = DiskStore(tmp_path, 2 * n)  # two entries fit
    good = make_chunk("k", seed=7).to_bytes(MAC)
    assert store.put_bytes("k", good) is PutResult.STORED
    (tmp_path / "k").write_bytes(flip_byte(good, len(good) - 40))

    pause = PausedDrop(store)
    t, out = _first_reader(store, "get_bytes", "k")
    assert pause.found.wait(WAIT_S)
    assert store.put(make_chunk("x", seed=1)) and store.put(make_chunk("y", seed=2))  # evicts k (least recent)
    assert not store.contains("k") and not (tmp_path / "k").exists()
    assert store.put_bytes("k", good) is PutResult.STORED  # evicts x
    pause.go.set()
    t.join(WAIT_S)
    assert not t.is_alive() and out == [None]

    _assert_holds_exactly(store, tmp_path, "k", good)
    assert sorted(disk_listing(tmp_path)) == ["k", "y"] and store.stats()["entries"] == 2


def test_a_late_drop_after_a_failed_read_leaves_a_good_file_put_since(tmp_path):
    """The same for a thing that is no file of the tier's (here the key's path became a directory; a FIFO or a
    link is dropped the same way): the first reader's drop, late, leaves the good file put once the bad one was
    cleared away."""
    store = DiskStore(tmp_path, 1 << 24)
    good = make_chunk("k", seed=7).to_bytes(MAC)
    assert store.put_bytes("k", good) is PutResult.STORED
    (tmp_path / "k").unlink()
    (tmp_path / "k").mkdir()

    pause = PausedDrop(store, "_drop_foreign")
    t, out = _first_reader(store, "get_bytes", "k")
    assert pause.found.wait(WAIT_S)
    assert store.get_bytes("k") is None and not store.contains("k")  # the second reader: dropped from the index
    (tmp_path / "k").rmdir()  # the unreadable thing is cleared away (it was no file to unlink)
    assert store.put_bytes("k", good) is PutResult.STORED
    pause.go.set()
    t.join(WAIT_S)
    assert not t.is_alive() and out == [None]

    _assert_holds_exactly(store, tmp_path, "k", good)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")
def test_the_corrupt_file_stays_open_until_its_drop_is_decided(tmp_path):
    """Why a late drop can tell the files apart by inode: the reader still holds the corrupt file open, so its
    inode is not freed, and the good file put since cannot get its number (ext4 hands a freed inode number to
    the next file created, at once)."""
    store = DiskStore(tmp_path, 1 << 24)
    good = make_chunk("k", seed=7).to_bytes(MAC)
    assert store.put_bytes("k", good) is PutResult.STORED
    (tmp_path / "k").write_bytes(flip_byte(good, len(good) - 40))
    old = os.stat(tmp_path / "k")

    pause = PausedDrop(store)
    t, out = _first_reader(store, "get", "k")
    assert pause.found.wait(WAIT_S)
    assert store.get("k") is None  # dropped by the second reader
    assert store.put_bytes("k", good) is PutResult.STORED
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    assert f"{tmp_path / 'k'} (deleted)" in links  # the first reader's descriptor: the unlinked corrupt file
    assert os.stat(tmp_path / "k").st_ino != old.st_ino
    pause.go.set()
    t.join(WAIT_S)
    assert not t.is_alive() and out == [None]
    _assert_holds_exactly(store, tmp_path, "k", good)


@pytest.mark.parametrize("how", ["get", "get_bytes"])
def test_two_readers_of_one_corrupt_file_still_drop_it(tmp_path, how):
    """With nothing put since, both drops run (the second finds the file gone): the file and its entry go,
    each read a miss, each counted."""
    store = DiskStore(tmp_path, 1 << 24)
    good = make_chunk("k", seed=7).to_bytes(MAC)
    assert store.put_bytes("k", good) is PutResult.STORED
    (tmp_path / "k").write_bytes(good[: len(good) // 2])  # truncated

    pause = PausedDrop(store)
    t, out = _first_reader(store, how, "k")
    assert pause.found.wait(WAIT_S)
    assert _read(store, how, "k") is None
    pause.go.set()
    t.join(WAIT_S)
    assert not t.is_alive() and out == [None]
    assert disk_listing(tmp_path) == [] and not store.contains("k")
    s = store.stats()
    assert (s["entries"], s["bytes"], s["corrupt_dropped"], s["misses"], s["hits"]) == (0, 0, 2, 2, 0)
    assert store.put_bytes("k", good) is PutResult.STORED and store.get_bytes("k") == good


def test_a_corrupt_file_read_once_is_dropped_and_no_descriptor_is_left_open(tmp_path):
    """The plain case: one read of a corrupt file drops it; a hit, a miss and a layout refusal each close the
    file they opened."""
    from flashpd.kv_bridge.chunk import LayoutMismatch
    from flashpd.kv_bridge.layout import ChunkLayout

    store = DiskStore(tmp_path, 1 << 24)
    good = make_chunk("k", seed=7)
    assert store.put(good) and store.put(make_chunk("bad", seed=8))
    data = (tmp_path / "bad").read_bytes()
    (tmp_path / "bad").write_bytes(flip_byte(data, len(data) - 40))

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0

    before = open_fds()
    for _ in range(3):
        assert same(store.get("k"), good) and store.get_bytes("k") == good.to_bytes(MAC)
    t = good.target_kv.shape  # [layers, 2, tokens, kv_heads, head_dim]
    wrong = ChunkLayout(t[0], t[3], t[4], t[2], "bfloat16", good.draft_kv.shape[0], "another-method")
    with pytest.raises(LayoutMismatch):
        store.get("k", wrong)
    assert store.stats()["layout_refused"] == 1 and store.contains("k")  # a valid entry: kept
    assert store.get("bad") is None and not (tmp_path / "bad").exists() and not store.contains("bad")
    assert store.get_bytes("bad") is None  # gone from the index: a plain miss
    assert open_fds() == before
    s = store.stats()
    assert (s["corrupt_dropped"], s["entries"]) == (1, 1)


def test_a_late_corrupt_drop_leaves_the_write_behind_copy(tmp_path):
    """Through the tiered store: two readers miss memory and find the disk copy corrupt; the second drops it, a
    put queues a good copy and the write-behind writer publishes it; the first reader's late drop leaves it."""
    from flashpd.kv_bridge.disk import TieredStore
    from flashpd.kv_bridge.store import MemoryStore

    disk = DiskStore(tmp_path, 1 << 24)
    store = TieredStore(MemoryStore(1 << 24), disk)
    good = make_chunk("k", seed=7).to_bytes(MAC)
    assert store.put_bytes("k", good) is PutResult.STORED and store.flush(WAIT_S)
    assert store.memory.remove("k") and disk.contains("k")
    (tmp_path / "k").write_bytes(flip_byte(good, len(good) - 40))

    pause = PausedDrop(disk)
    t, out = _first_reader(store, "get_bytes", "k")
    assert pause.found.wait(WAIT_S)
    assert store.get_bytes("k") is None and not disk.contains("k")
    assert store.put_bytes("k", good) is PutResult.STORED and store.flush(WAIT_S)  # written behind, published
    assert store.stats()["disk_written"] == 2
    pause.go.set()
    t.join(WAIT_S)
    assert not t.is_alive() and out == [None]

    assert store.close(WAIT_S)
    _assert_holds_exactly(disk, tmp_path, "k", good)
    assert DiskStore(tmp_path, 1 << 24).get_bytes("k") == good  # and a restart finds it


def test_a_file_removed_from_under_the_store_leaves_its_index(tmp_path):
    """An operator, or another bridge sharing the directory (its evictions delete files it did not write), removes
    an entry's file: the entry leaves the index and the budget at its first miss. Kept, Lookup went on reporting it,
    every Get missed it, and putting it again was PRESENT, never rewritten."""
    store = DiskStore(tmp_path, 1 << 24)
    c = make_chunk("k", seed=7)
    assert store.put(c)
    (tmp_path / "k").unlink()
    assert store.contains("k")  # the store cannot know before it looks
    assert store.get("k") is None
    s = store.stats()
    assert (s["entries"], s["bytes"], s["files_vanished"]) == (0, 0, 1) and not store.contains("k")
    assert store.put_bytes("k", c.to_bytes(MAC)) == PutResult.STORED
    assert (tmp_path / "k").exists() and same(store.get("k"), c)


def test_a_hit_whose_recency_cannot_be_written_is_still_served(tmp_path, monkeypatch, caplog):
    """On a read-only file system (ext4 remounted read-only after an error) os.utime raises EROFS: the hit's
    recency is not kept on disk, and the hit is served. It used to end the whole Get INTERNAL, at every hit.
    (The read-only file system itself cannot be made here: utime's failure is injected.)"""
    import errno  # noqa: PLC0415

    from flashpd.kv_bridge import disk as disk_mod  # noqa: PLC0415

    store = DiskStore(tmp_path, 1 << 24)
    c = make_chunk("k", seed=7)
    assert store.put(c)

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(disk_mod.os, "utime", read_only)
    for _ in range(3):
        assert same(store.get("k"), c)
    assert store.stats()["touch_errors"] == 3
    assert sum("cannot record a hit's recency" in r.message for r in caplog.records) == 1  # said once

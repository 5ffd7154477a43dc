"""What the disk tier finds at an entry's path that it never wrote is never read, served or removed (real files in a
tmp dir; found by a review that planted them under a running bridge):

- a FIFO: each Get blocked a bridge thread in open() for good (four took a 4-thread bridge down);
- a symbolic link (to /dev/zero: read without end; kept indexed, every Get read it again);
- a regular file larger than its entry (a 2 GiB file was read whole into memory, then refused);
- an operator's file under a key a Put then named: indexed as "present", then unlinked as corrupt.
"""
from __future__ import annotations

import os
import threading

from flashpd.kv_bridge.disk import DiskStore
from flashpd.kv_bridge.store import PutResult

try:
    from tests._kv_bridge_helpers import MAC, make_chunk, same
except ImportError:
    from _kv_bridge_helpers import MAC, make_chunk, same  # type: ignore

WAIT_S = 10.0


def _get_within(store: DiskStore, key: str) -> list:
    """store.get(key) on a thread, joined within WAIT_S (a read blocked in open() fails the test, not the run)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(store.get(key)), daemon=True)
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive(), f"a Get of {key} blocked"
    return out


def _stored(tmp_path, keys=("k", "other")) -> tuple[DiskStore, dict]:
    store = DiskStore(tmp_path, 1 << 24)
    chunks = {k: make_chunk(k, seed=i + 3) for i, k in enumerate(keys)}
    for c in chunks.values():
        assert store.put(c)
    return store, chunks


def _assert_dropped_and_left(store: DiskStore, path, other) -> None:
    s = store.stats()
    assert s["entries"] == 1 and s["foreign_dropped"] == 1 and not store.contains("k")
    assert os.path.lexists(path)  # not the tier's to remove
    assert same(store.get("other"), other)  # the other entry is untouched


def test_a_fifo_in_an_entrys_place_is_dropped_without_waiting(tmp_path):
    store, chunks = _stored(tmp_path)
    path = tmp_path / "k"
    path.unlink()
    os.mkfifo(path)
    assert _get_within(store, "k") == [None]
    _assert_dropped_and_left(store, path, chunks["other"])
    assert _get_within(store, "k") == [None] and store.stats()["foreign_dropped"] == 1  # a plain miss now


def test_a_symbolic_link_in_an_entrys_place_is_never_followed(tmp_path):
    store, chunks = _stored(tmp_path)
    path = tmp_path / "k"
    path.unlink()
    os.symlink("/dev/zero", path)
    assert _get_within(store, "k") == [None]
    _assert_dropped_and_left(store, path, chunks["other"])
    assert os.path.islink(path)


def test_a_file_of_another_size_is_dropped_unread(tmp_path, monkeypatch):
    store, chunks = _stored(tmp_path)
    path = tmp_path / "k"
    size = path.stat().st_size
    with open(path, "r+b") as f:  # sparse: as large as the read would be, without the disk space
        f.truncate(size + (64 << 20))
    import flashpd.kv_bridge.disk as disk

    reads = []
    real = disk._read_fd
    monkeypatch.setattr(disk, "_read_fd", lambda fd: reads.append(fd) or real(fd))
    assert _get_within(store, "k") == [None]
    assert not reads  # refused by its size, before a byte was read
    s = store.stats()
    assert s["entries"] == 1 and s["corrupt_dropped"] == 1 and not path.exists()  # a chunk file of the tier's: gone
    assert same(store.get("other"), chunks["other"])


def test_a_put_never_adopts_a_file_that_is_not_its_chunk(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("an operator's notes\n")
    store = DiskStore(tmp_path, 1 << 24)
    c = make_chunk("notes.txt", seed=5)
    assert store.put_bytes("notes.txt", c.to_bytes(MAC)) == PutResult.REFUSED
    s = store.stats()
    assert s["entries"] == 0 and s["foreign_refused"] == 1 and s["bytes"] == 0
    assert store.get("notes.txt") is None and notes.read_text() == "an operator's notes\n"
    # the same key's chunk written by another process sharing the directory is still adopted, first wins
    other = make_chunk("k2", seed=6)
    data = other.to_bytes(MAC)
    (tmp_path / "k2").write_bytes(data)
    assert store.put_bytes("k2", data) == PutResult.PRESENT and same(store.get("k2"), other)


def test_the_directory_is_made_the_owners_alone_and_a_shared_one_is_said(tmp_path, caplog):
    """Other users cannot forge an entry (MACs), but in a directory they may write in they can delete the tier's
    entries or fill its disk: a new directory is made 0700 (its parents as umask leaves them), and a found one that
    others may write in is logged once at start. A path that is a file fails the start, naming it."""
    new = tmp_path / "a" / "tier"
    DiskStore(new, 1 << 20).close()
    assert new.stat().st_mode & 0o777 == 0o700 and not caplog.records
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level("WARNING", logger="flashpd.kv_bridge.disk"):
        DiskStore(shared, 1 << 20).close()
    assert len(caplog.records) == 1 and "writable by other users" in caplog.text and str(shared) in caplog.text
    assert shared.stat().st_mode & 0o777 == 0o777  # the operator's directory: said, not changed
    (tmp_path / "file").write_text("x")
    try:
        DiskStore(tmp_path / "file", 1 << 20)
    except NotADirectoryError as e:
        assert str(tmp_path / "file") in str(e)
    else:
        raise AssertionError("a file as the tier's directory was accepted")

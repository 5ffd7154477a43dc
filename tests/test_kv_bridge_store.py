"""KV bridge stores without the network: memory LRU, disk persistence and atomicity, the tiered store."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from flashpd.kv_bridge import disk
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.chunk import CorruptChunk, join_parts
from flashpd.kv_bridge.disk import DiskStore, TieredStore
from flashpd.kv_bridge.keys import chunk_keys
from flashpd.kv_bridge.store import ByteStore, ChunkStore, MemoryStore, PutResult

try:
    from tests._kv_bridge_helpers import (CHUNK_TOKENS, MAC, disk_listing, fingerprint, flip_byte, make_chunk,
                                          prompt_chunks, same)
except ImportError:
    from _kv_bridge_helpers import (CHUNK_TOKENS, MAC, disk_listing, fingerprint, flip_byte, make_chunk,  # type: ignore
                                    prompt_chunks, same)

VARIANTS = [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True), (torch.float32, False)]


@pytest.fixture(params=["memory", "disk", "tiered"])
def store(request, tmp_path):
    if request.param == "memory":
        return MemoryStore(1 << 24)
    if request.param == "disk":
        return DiskStore(tmp_path / "disk", 1 << 24)
    return TieredStore(MemoryStore(1 << 24), DiskStore(tmp_path / "disk", 1 << 24))


def test_protocols(store):
    assert isinstance(store, ChunkStore) and isinstance(store, ByteStore)


@pytest.mark.parametrize("dtype,draft", VARIANTS)
def test_round_trip_byte_exact(store, dtype, draft):
    c = make_chunk("k0", dtype=dtype, draft=draft, seed=3)
    assert store.put(c)
    got = store.get("k0")
    assert got is not None and same(got, c)
    assert got.target_kv.dtype == dtype and (got.draft_kv is not None) == draft
    assert torch.equal(got.target_kv, c.target_kv)
    if draft:
        assert torch.equal(got.draft_kv, c.draft_kv)
    assert store.get_bytes("k0") == c.to_bytes(MAC)


def test_lookup_counts_leading_hits_only(store):
    for k in ("a", "b", "d"):
        store.put(make_chunk(k))
    assert store.lookup(["a", "b", "c", "d"]) == 2
    assert store.lookup(["x", "a", "b"]) == 0
    assert store.lookup(["a", "b", "d"]) == 3
    assert store.lookup([]) == 0
    assert store.get("c") is None


def test_wrong_fingerprint_is_a_miss(store):
    tokens = list(range(100, 100 + 4 * CHUNK_TOKENS))
    fp_a, fp_b = fingerprint("drafter-a"), fingerprint("none")  # same target, another method
    for c in prompt_chunks(tokens, fp_a):
        store.put(c)
    keys_a, keys_b = chunk_keys(tokens, CHUNK_TOKENS, fp_a), chunk_keys(tokens, CHUNK_TOKENS, fp_b)
    assert not set(keys_a) & set(keys_b)
    assert store.lookup(keys_a) == 4
    assert store.lookup(keys_b) == 0
    assert all(store.get(k) is None for k in keys_b)


def test_corrupt_put_refused_and_counted(store):
    data = make_chunk("k0").to_bytes(MAC)
    foreign = make_chunk("k0").to_bytes(ClusterSecret.generate().mac_key)  # sealed under another secret
    for bad in (flip_byte(data, len(data) // 2), data[:-1], make_chunk("other").to_bytes(MAC), foreign):
        with pytest.raises(CorruptChunk):
            store.put_bytes("k0", bad)
    assert not store.contains("k0") and store.get("k0") is None
    s = store.stats()
    assert s["corrupt_refused"] == 4
    assert store.put_bytes("k0", data) is PutResult.STORED


def test_concurrent_puts_of_one_key(store):
    c = make_chunk("same", seed=7)
    data = c.to_bytes(MAC)
    barrier = threading.Barrier(8, timeout=10)
    results: list[PutResult] = []

    def worker() -> None:
        barrier.wait()
        results.append(store.put_bytes("same", data))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()
    assert sorted(r.value for r in results) == ["present"] * 7 + ["stored"]
    assert store.lookup(["same"]) == 1 and same(store.get("same"), c)
    if isinstance(store, DiskStore):
        assert sorted(disk_listing(store.directory)) == ["same"]  # one file, no temp left behind


# -- memory tier --------------------------------------------------------------------------------
def _size() -> int:
    return len(make_chunk("x").to_bytes(MAC))


def test_memory_lru_evicts_whole_entries():
    n = _size()
    store = MemoryStore(3 * n + n // 2)  # room for three entries
    for k in ("a", "b", "c"):
        assert store.put(make_chunk(k))
    assert store.get("a") is not None  # a is now the most recent: b goes first
    assert store.put(make_chunk("d"))
    assert [store.contains(k) for k in "abcd"] == [True, False, True, True]
    assert store.get("b") is None  # target and draft halves gone together: no half entry
    for k in "acd":
        got = store.get(k)
        assert got.target_kv is not None and got.draft_kv is not None
    s = store.stats()
    assert s["evictions"] == 1 and s["entries"] == 3 and s["bytes"] == 3 * n


def test_memory_refuses_an_entry_larger_than_the_budget():
    store = MemoryStore(_size() - 1)
    assert not store.put(make_chunk("big"))
    assert store.stats()["oversize_refused"] == 1 and store.stats()["entries"] == 0


def test_memory_corrupt_entry_dropped_at_get():
    store = MemoryStore(1 << 20)
    store.put(make_chunk("k"))
    store._index["k"] = flip_byte(store._index["k"], 100)  # memory rot
    assert store.get("k") is None
    s = store.stats()
    assert s["corrupt_dropped"] == 1 and s["entries"] == 0 and s["bytes"] == 0 and s["hits"] == 0


# -- eviction along prompts (memory and disk) ----------------------------------------------------
def _tiers(tmp_path, budget: int) -> dict:
    return {"memory": MemoryStore(budget), "disk": DiskStore(tmp_path / "disk", budget)}


def _held(store, keys: list[str]) -> int:
    return sum(store.contains(k) for k in keys)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_eviction_takes_a_prompts_tail_first_and_leaves_no_useless_chunks(tmp_path, tier):
    """Room for 8 chunks; prompt A's 6, a hit on A's first 3 (as a restore reads them), then prompt B's 6. Plain
    LRU evicted A's leading chunks (read first, so least recent), leaving A's tail held and useless (a hit needs
    every chunk before it); here A loses its tail, and every held chunk of each prompt is part of its hit."""
    n = _size()
    store = _tiers(tmp_path, 8 * n + n // 2)[tier]
    fp = fingerprint()
    a = prompt_chunks(list(range(6 * CHUNK_TOKENS)), fp, seed=1)
    b = prompt_chunks(list(range(1000, 1000 + 6 * CHUNK_TOKENS)), fp, seed=2)
    for c in a:
        assert store.put(c)
    for c in a[:3]:
        assert store.get(c.key) is not None
    for c in b:
        assert store.put(c)
    ka, kb = [c.key for c in a], [c.key for c in b]
    assert store.lookup(kb) == 6
    assert store.lookup(ka) == _held(store, ka) == 2  # A0, A1: A5, A4, A3 went first, then A2
    assert store.stats()["evictions"] == 4


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_prompt_longer_than_the_budget_keeps_its_leading_chunks(tmp_path, tier):
    """10 chunks of one prompt into room for 8: the first 8 stay; the last 2 are refused, since storing them
    would evict their own prompt's chunks (plain LRU kept chunks 2-9, none of them usable)."""
    n = _size()
    store = _tiers(tmp_path, 8 * n + n // 2)[tier]
    chunks = prompt_chunks(list(range(10 * CHUNK_TOKENS)), fingerprint(), seed=3)
    results = [store.put(c) for c in chunks]
    assert results == [True] * 8 + [False] * 2
    assert store.lookup([c.key for c in chunks]) == 8 and store.stats()["chain_refused"] == 2


def test_disk_learns_parents_after_a_restart(tmp_path):
    """After a restart a hit (re)learns an entry's parent from its verified bytes, and from then on the prompt's
    leading chunks stay more recent than its tail."""
    n = _size()
    fp = fingerprint()
    a = prompt_chunks(list(range(4 * CHUNK_TOKENS)), fp, seed=4)
    first = DiskStore(tmp_path, 6 * n + n // 2)
    for c in a:
        first.put(c)
    store = DiskStore(tmp_path, 6 * n + n // 2)
    for c in a:
        assert store.get(c.key) is not None  # read in order: A0 least recent by plain LRU
    for c in prompt_chunks(list(range(500, 500 + 3 * CHUNK_TOKENS)), fp, seed=5):
        assert store.put(c)
    ka = [c.key for c in a]
    assert store.lookup(ka) == _held(store, ka) == 3


# -- disk tier ----------------------------------------------------------------------------------
def _put_in_order(store: DiskStore, chunks, t0: int = 0) -> None:
    """Put each chunk and give its file a distinct, increasing mtime (what puts seconds apart leave)."""
    for i, c in enumerate(chunks):
        assert store.put(c)
        os.utime(store.directory / c.key, ns=(10**18 + (t0 + i) * 10**9,) * 2)


def test_disk_restart_keeps_a_prompts_head_and_protects_its_prefix(tmp_path):
    """After a restart the order comes from mtimes, where a prompt's first chunk (put and read first) is the
    oldest file: eviction cut every prompt at its head, leaving its other chunks held but unreachable, and a put
    extending a prompt evicted that prompt's own first chunk. The scan reads each header's parent so the order
    is the running store's: the tail goes first, and an extending put that could only evict its own prefix is
    refused."""
    n = _size()
    fp = fingerprint()
    a = prompt_chunks(list(range(6 * CHUNK_TOKENS)), fp, seed=11)
    ka = [c.key for c in a]
    _put_in_order(DiskStore(tmp_path / "x", 5 * n + n // 2), a[:5])
    store = DiskStore(tmp_path / "x", 5 * n + n // 2)
    assert not store.put(a[5]) and store.stats()["chain_refused"] == 1
    assert store.lookup(ka) == _held(store, ka) == 5
    _put_in_order(DiskStore(tmp_path / "y", 5 * n + n // 2), a[:5])
    store = DiskStore(tmp_path / "y", 5 * n + n // 2)
    b = prompt_chunks(list(range(500, 500 + CHUNK_TOKENS)), fp, seed=12)
    assert store.put(b[0])
    assert store.lookup(ka) == _held(store, ka) == 4  # A4 went, not A0
    assert store.lookup([b[0].key]) == 1


def test_disk_restart_evicts_unreachable_chunks_first(tmp_path):
    """Chunks no hit can reach after a restart (their parent's file is gone, or their header is unreadable)
    are evicted before any reachable chunk, even an older one. A file without the chunk magic is no entry: not
    counted, never evicted."""
    n = _size()
    fp = fingerprint()
    a = prompt_chunks(list(range(3 * CHUNK_TOKENS)), fp, seed=21)
    b = prompt_chunks(list(range(700, 700 + 2 * CHUNK_TOKENS)), fp, seed=31)
    first = DiskStore(tmp_path, 1 << 24)
    _put_in_order(first, a)
    _put_in_order(first, b, t0=10)  # B is the most recent prompt
    (tmp_path / b[0].key).unlink()  # B1 is an orphan now
    (tmp_path / "junk").write_bytes(b"FPKV\x02\x00\x00\x00\xff\xff\x00\x00")  # a chunk file whose header is cut
    os.utime(tmp_path / "junk", ns=(10**18 + 50 * 10**9,) * 2)
    (tmp_path / "notes.txt").write_bytes(b"an operator's file" * 1000)  # no chunk magic: not the tier's
    store = DiskStore(tmp_path, 4 * n + n // 2)  # room for 4: A (3) and the orphan B1 fit, the junk too
    c = prompt_chunks(list(range(900, 900 + 2 * CHUNK_TOKENS)), fp, seed=41)
    assert store.put(c[0])  # the orphan B1 goes, though newer than all of A
    assert not store.contains(b[1].key) and store.contains("junk")
    assert store.lookup([x.key for x in a]) == 3 and store.lookup([c[0].key]) == 1
    assert store.put(c[1])  # the junk goes first, then A's tail
    assert not store.contains("junk") and not (tmp_path / "junk").exists()
    assert store.lookup([x.key for x in a]) == 2 and store.lookup([x.key for x in c]) == 2
    assert not store.contains("notes.txt") and (tmp_path / "notes.txt").read_bytes() == b"an operator's file" * 1000
    assert store.stats()["bytes"] == sum(os.path.getsize(tmp_path / k) for k in disk_listing(tmp_path)
                                         if k != "notes.txt")


@pytest.mark.parametrize("seed", range(4))
def test_disk_restart_rebuilds_the_running_order(tmp_path, seed):
    """Prompts sharing prefixes, put in order and read (a prefix each), each file touched at a distinct time: a
    restarted store's LRU order is the one the running store had."""
    import random

    rng = random.Random(seed)
    fp = fingerprint()
    store = DiskStore(tmp_path, 1 << 24)
    clock = iter(range(10**18, 10**19, 10**9))
    prompts = []
    for i in range(8):
        base = rng.choice(prompts)[:rng.randint(0, 3) * CHUNK_TOKENS] if prompts and rng.random() < 0.6 else []
        tokens = base + [rng.randrange(50000) for _ in range(rng.randint(1, 4) * CHUNK_TOKENS)]
        prompts.append(tokens)
    chunks = {}
    for _ in range(40):
        tokens = rng.choice(prompts)
        cs = prompt_chunks(tokens, fp, seed=rng.randrange(1000))
        n = rng.randint(1, len(cs))
        if rng.random() < 0.5:
            for c in cs[:n]:
                if c.key not in chunks:
                    assert store.put(c)
                    chunks[c.key] = c
                    t = next(clock)
                    os.utime(tmp_path / c.key, ns=(t, t))
        else:
            for c in cs[:n]:
                if c.key not in chunks:
                    break
                assert store.get(c.key) is not None
                t = next(clock)
                os.utime(tmp_path / c.key, ns=(t, t))
    again = DiskStore(tmp_path, 1 << 24)
    assert list(again._index) == list(store._index)


def test_disk_scan_survives_files_that_vanish_or_are_malformed(tmp_path, monkeypatch):
    """Another process sharing the directory may evict a file between the scan's listing and its stat; an empty
    or garbage file may sit under a key-like name: the store starts, and neither is ever served."""
    store = DiskStore(tmp_path, 1 << 24)
    for k in ("k1", "k2", "k3"):
        store.put(make_chunk(k))
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "garbage").write_bytes(os.urandom(300))
    real_scandir = os.scandir

    def racing_scandir(path):
        it = real_scandir(path)
        listed = list(it)
        it.close()
        (tmp_path / "k2").unlink()  # evicted by another process after the listing

        class _It:
            def __enter__(self):
                return iter(listed)

            def __exit__(self, *exc):
                return False

            def __iter__(self):
                return iter(listed)
        return _It()

    monkeypatch.setattr(os, "scandir", racing_scandir)
    again = DiskStore(tmp_path, 1 << 24)
    monkeypatch.undo()
    assert again.lookup(["k1"]) == 1 and again.lookup(["k3"]) == 1 and not again.contains("k2")
    assert again.get("empty") is None and again.get("garbage") is None
    assert again.stats()["entries"] == 2 and again.get("k1") is not None


def test_disk_survives_restart_byte_exact(tmp_path):
    chunks = [make_chunk(f"k{i}", dtype=dt, draft=d, seed=i) for i, (dt, d) in enumerate(VARIANTS)]
    store = DiskStore(tmp_path, 1 << 24)
    for c in chunks:
        store.put(c)
    again = DiskStore(tmp_path, 1 << 24)
    assert again.lookup([c.key for c in chunks]) == len(chunks)
    assert again.stats()["bytes"] == sum(len(c.to_bytes(MAC)) for c in chunks)
    for c in chunks:
        assert same(again.get(c.key), c)


def test_disk_lru_by_access_time_across_restart(tmp_path):
    n = _size()
    store = DiskStore(tmp_path, 3 * n + n // 2)
    for i, k in enumerate("abc"):
        store.put(make_chunk(k))
        os.utime(tmp_path / k, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # distinct, ordered times
    store.get("a")  # touched now: newer than b and c
    again = DiskStore(tmp_path, 3 * n + n // 2)
    again.put(make_chunk("d"))
    assert [again.contains(k) for k in "abcd"] == [True, False, True, True]
    assert not (tmp_path / "b").exists()
    assert DiskStore(tmp_path, n + n // 2).lookup(["d"]) == 1  # a smaller budget evicts at start
    assert sorted(disk_listing(tmp_path)) == ["d"]


def test_disk_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 24)

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    assert store.put_bytes("k", make_chunk("k").to_bytes(MAC)) is PutResult.REFUSED
    monkeypatch.undo()
    assert disk_listing(tmp_path) == [] and not store.contains("k") and store.stats()["write_errors"] == 1
    # a process killed mid-write leaves a temp file: never visible, deleted at the next start once stale; a fresh
    # one may be another process's write in progress into the same directory: left to it
    old = tmp_path / ".tmp-k-123"
    old.write_bytes(make_chunk("k").to_bytes(MAC)[:500])
    past = time.time() - disk.STALE_TMP_S - 60
    os.utime(old, (past, past))
    (tmp_path / ".tmp-j-456").write_bytes(make_chunk("j").to_bytes(MAC)[:500])
    again = DiskStore(tmp_path, 1 << 24)
    assert again.lookup(["k"]) == again.lookup(["j"]) == 0 and disk_listing(tmp_path) == [".tmp-j-456"]
    assert again.stats()["temp_files_removed"] == 1


def test_disk_temp_file_of_a_dead_writer_on_this_host_goes_at_the_next_start(tmp_path):
    """A writer killed mid-write leaves a temp file that names its host and pid: a restart sooner than STALE_TMP_S
    removes it once that process is gone. A live writer's (this process, another live process) and another
    host's fresh temp files stay; the 600 s rule still covers them."""
    import subprocess
    import sys

    data = make_chunk("k").to_bytes(MAC)[:500]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_name = disk._temp_name("k").replace(f"-{os.getpid()}-", f"-{gone.pid}-", 1)
        live_name = disk._temp_name("j").replace(f"-{os.getpid()}-", f"-{alive.pid}-", 1)
        mine = disk._temp_name("m")
        other_host = ".tmp-0badc0de-" + f"{gone.pid}-k-0123456789abcdef"
        for name in (dead_name, live_name, mine, other_host):
            (tmp_path / name).write_bytes(data)
        again = DiskStore(tmp_path, 1 << 24)
        assert sorted(disk_listing(tmp_path)) == sorted([live_name, mine, other_host])
        assert again.stats()["temp_files_removed"] == 1 and again.stats()["entries"] == 0
    finally:
        alive.kill()
        alive.wait()
    assert len(disk._temp_name("k" * 200)) <= 255


def test_disk_temp_files_are_judged_by_age_alone_where_the_pid_namespace_is_unknown(tmp_path, monkeypatch):
    """Without /proc's boot id or pid namespace, two containers of one host name could share a tag, and a live
    writer in the other's namespace would look gone: no name is then trusted, only the 600 s rule."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    name = disk._temp_name("k").replace(f"-{os.getpid()}-", f"-{gone.pid}-", 1)
    monkeypatch.setattr(disk, "_HOST", None)
    (tmp_path / name).write_bytes(b"x")
    DiskStore(tmp_path, 1 << 24)
    assert disk_listing(tmp_path) == [name]


class _SmallDisk:
    """A file system of `capacity` bytes under one directory (os.write through the store's write_all raises
    ENOSPC past it): a disk that other users filled below this tier's budget. No real small file system can be
    mounted on a CI machine without privileges."""

    def __init__(self, directory, capacity: int) -> None:
        import errno

        self.directory, self.capacity, self.real = directory, capacity, disk.write_all
        self.errno = errno.ENOSPC

    def __call__(self, fd: int, data) -> None:
        used = sum(os.path.getsize(self.directory / f) for f in disk_listing(self.directory))
        if used + len(data) > self.capacity:
            raise OSError(self.errno, "No space left on device")
        self.real(fd, data)


def test_disk_full_below_the_budget_evicts_instead_of_freezing(tmp_path, monkeypatch):
    """The file system fills up with this tier's budget far from reached: each write that finds no room drops the
    least recently used files and is tried once more, so the tier keeps its most recent entries instead of
    refusing every write from then on with nothing evicted."""
    n = _size()
    store = DiskStore(tmp_path, 100 * n)
    monkeypatch.setattr(disk, "write_all", _SmallDisk(tmp_path, 3 * n + n // 2))
    keys = [f"k{i}" for i in range(8)]
    for k in keys:
        assert store.put_bytes(k, make_chunk(k).to_bytes(MAC)) is PutResult.STORED, k
    assert store.lookup(keys[-2:]) == 2 and store.get("k7") is not None
    s = store.stats()
    assert s["entries"] == 3 and s["space_evictions"] == 5 and s["write_errors"] == 0
    assert sorted(disk_listing(tmp_path)) == ["k5", "k6", "k7"]
    assert s["bytes"] == sum(os.path.getsize(tmp_path / k) for k in disk_listing(tmp_path))


def test_disk_full_with_nothing_of_its_own_to_drop_refuses(tmp_path, monkeypatch):
    """A disk full of other users' files, this tier holding nothing: the write is refused (counted), not retried
    forever, and nothing is left behind."""
    n = _size()
    store = DiskStore(tmp_path, 100 * n)
    monkeypatch.setattr(disk, "write_all", _SmallDisk(tmp_path, n // 2))
    assert store.put_bytes("k", make_chunk("k").to_bytes(MAC)) is PutResult.REFUSED
    s = store.stats()
    assert (s["entries"], s["write_errors"], s["space_evictions"]) == (0, 1, 0)
    assert disk_listing(tmp_path) == []


def test_disk_corrupt_file_refused_and_deleted(tmp_path):
    store = DiskStore(tmp_path, 1 << 24)
    store.put(make_chunk("k1"))
    store.put(make_chunk("k2"))
    data = (tmp_path / "k1").read_bytes()
    (tmp_path / "k1").write_bytes(flip_byte(data, len(data) - 40))
    (tmp_path / "k2").write_bytes(data[: len(data) // 2])  # truncated by something outside the store
    assert store.get("k1") is None and store.get_bytes("k2") is None
    assert disk_listing(tmp_path) == []
    s = store.stats()
    assert s["corrupt_dropped"] == 2 and s["entries"] == 0 and s["bytes"] == 0


def test_disk_file_that_cannot_be_read_is_a_miss_and_leaves_the_index(tmp_path):
    """An I/O error other than a missing file (here the entry's path became a directory: EISDIR, as EIO or
    EACCES would) is a miss, never an exception out of the store."""
    store = DiskStore(tmp_path, 1 << 24)
    store.put(make_chunk("k1"))
    (tmp_path / "k1").unlink()
    (tmp_path / "k1").mkdir()
    assert store.get("k1") is None and store.get_bytes("k1") is None
    s = store.stats()
    assert (s["entries"], s["bytes"], s["misses"]) == (0, 0, 2)
    assert store.put(make_chunk("k2")) and store.get("k2") is not None  # the store goes on


def test_disk_failed_publish_leaves_no_parent_entry(tmp_path, monkeypatch):
    """A write that fails after its header's parent was recorded (the hard link into place: ENOSPC, EIO) is
    refused; its parent record must go with it, or a disk that keeps failing grows the table without bound."""
    import errno

    store = DiskStore(tmp_path, 1 << 24)
    chunks = prompt_chunks(list(range(20 * CHUNK_TOKENS)), fingerprint(), seed=51)
    assert store.put(chunks[0])

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "link", no_space)
    assert not any(store.put(c) for c in chunks[1:])
    monkeypatch.undo()
    assert store.stats()["write_errors"] == 19 and store.stats()["entries"] == 1
    assert store._parent == {}
    assert disk_listing(tmp_path) == [chunks[0].key]
    assert store.put(chunks[1]) and store.lookup([c.key for c in chunks]) == 2


def test_disk_rejects_keys_that_are_paths(tmp_path):
    store = DiskStore(tmp_path / "d", 1 << 24)
    for bad in ("../escape", "a/b", ".hidden", ""):
        with pytest.raises(ValueError):
            store.put_bytes(bad, make_chunk(bad or "x").to_bytes(MAC), verified=True)


# -- tiered -------------------------------------------------------------------------------------
def test_tiered_write_through_promotion_and_hits_by_tier(tmp_path):
    n = _size()
    mem, disk = MemoryStore(2 * n + n // 2), DiskStore(tmp_path, 1 << 24)
    store = TieredStore(mem, disk)
    chunks = [make_chunk(k, seed=i) for i, k in enumerate("abc")]
    for c in chunks:
        store.put(c)
    assert store.flush(10)  # the disk tier is written behind the puts
    assert disk.lookup(["a", "b", "c"]) == 3 and not mem.contains("a")  # a fell out of memory only
    assert store.lookup(["a", "b", "c", "z"]) == 3
    assert same(store.get("b"), chunks[1])  # memory
    assert same(store.get("a"), chunks[0])  # disk, promoted
    assert mem.contains("a")
    assert store.get("z") is None
    s = store.stats()
    assert (s["hits_memory"], s["hits_disk"], s["misses"]) == (1, 1, 1)
    assert s["disk"]["entries"] == 3 and s["memory"]["entries"] == 2
    # a restart with a cold memory tier still finds everything on disk
    cold = TieredStore(MemoryStore(1 << 24), DiskStore(tmp_path, 1 << 24))
    assert all(same(cold.get(c.key), c) for c in chunks)
    assert cold.stats()["hits_disk"] == 3


def test_a_memory_stores_put_keeps_the_chunks_bytes_read_only_in_memory_of_their_own():
    secret = ClusterSecret.generate()
    s = MemoryStore(1 << 26, secret)
    c = make_chunk("v0", seed=3)
    assert s.put(c)
    held = s.get_bytes("v0")
    assert isinstance(held, memoryview) and held.readonly
    assert bytes(held) == c.to_bytes(secret.mac_key)
    c.target_kv.zero_()  # the chunk's tensors are not what the entry holds
    assert bytes(s.get_bytes("v0")) != c.to_bytes(secret.mac_key)
    assert bytes(join_parts([b"ab", memoryview(b"cd"), b"", bytearray(b"e")])) == b"abcde"


def test_memory_tier_frees_evicted_entries_without_a_garbage_collection():
    """Evicted entries must not wait for a full collection (a serving process rarely runs one): the bridge's
    memory tier grew linearly past its budget while it reported holding only that budget."""
    import gc

    from flashpd.kv_bridge.lru import _Node

    n = _size()
    store = MemoryStore(4 * n)
    gc.collect()
    before = sum(isinstance(o, _Node) for o in gc.get_objects())  # other tests' indexes still referenced
    gc.disable()
    try:
        for p in range(60):  # prompts of 1-3 chunks, each chunk's parent the one before it
            keys = [f"p{p}c{i}" for i in range(1 + p % 3)]
            for i, k in enumerate(keys):
                assert store.put(make_chunk(k, parent=keys[i - 1] if i else ""))
        nodes = sum(isinstance(o, _Node) for o in gc.get_objects()) - before
        held = store.stats()["entries"]
    finally:
        gc.enable()
    assert store.stats()["evictions"] > 50
    assert nodes <= held + 1, f"{nodes} index nodes alive for {held} entries (+1 sentinel)"

"""The bridge's shared-memory arena (kv_bridge/arena.py, arena_store.py): slots, holds, seals, and the client's
checks on the handles it is sent. Real memfds, a real gRPC server on 127.0.0.1, and a real server process."""
from __future__ import annotations

import fcntl
import mmap
import os
import time
import weakref
from dataclasses import replace

import pytest
import torch

from flashpd.kv_bridge import arena, shm
from flashpd.kv_bridge.arena import PAGE, Arena, ArenaError, ArenaMaps, ArenaRef
from flashpd.kv_bridge.arena_store import ArenaStore
from flashpd.kv_bridge.chunk import KVChunk, Lease
from flashpd.kv_bridge.client import BridgeClient, BridgeProtocolError, _in_arena
from flashpd.kv_bridge.frame_codec import Frame, ShmRef
from flashpd.kv_bridge.server import serve
from flashpd.kv_bridge.store import MemoryStore, PutResult
from flashpd.kv_bridge.wire import Assembler

from tests._cluster_helpers import dflash_pair  # noqa: F401  (session fixture)

pytestmark = pytest.mark.skipif(not arena.available(), reason="memfd arenas are Linux-only")


def chunk(i: int, tokens: int = 8, parent: str = "") -> KVChunk:
    g = torch.Generator().manual_seed(i)
    return KVChunk(f"{i:064x}", parent, "fp", list(range(tokens)), torch.randn(2, 2, tokens, 2, 16, generator=g),
                   torch.randn(1, 2, tokens, 2, 16, generator=g))


def same(a: KVChunk, b: KVChunk) -> bool:
    return a.key == b.key and torch.equal(a.target_kv, b.target_kv) and torch.equal(a.draft_kv, b.draft_kv)


def test_slots_are_page_aligned_first_fit_and_freed_slots_coalesce():
    a = Arena(8 * PAGE)
    x, y, z = a.alloc(1), a.alloc(PAGE + 1), a.alloc(PAGE)
    assert (x, y, z) == (0, PAGE, 3 * PAGE)
    assert a.alloc(5 * PAGE) is None  # 4 pages are left
    a.free(x, 1)
    a.free(y, PAGE + 1)
    assert a.alloc(3 * PAGE) == 0  # the two freed slots became one
    assert a.alloc(4 * PAGE) == 4 * PAGE


def test_a_held_slot_is_not_reused_until_its_hold_has_passed():
    a = Arena(2 * PAGE)
    x = a.alloc(PAGE)
    a.alloc(PAGE)
    a.free(x, PAGE, time.monotonic() + 2.0)  # long enough that a loaded machine's pause does not pass it
    assert a.alloc(PAGE) is None and a.held_bytes() == PAGE
    time.sleep(2.05)
    assert a.alloc(PAGE) == x and a.held_bytes() == 0


def test_the_arena_cannot_shrink_or_grow_so_a_mapping_never_faults_past_its_end():
    a = Arena(4 * PAGE)
    seals = fcntl.fcntl(a.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
    for n in (PAGE, 8 * PAGE):
        with pytest.raises(PermissionError):
            os.ftruncate(a.fd, n)


def test_only_the_bridges_own_mapping_can_change_an_entry():
    """Another process of the same user opens the arena writable through /proc: its writes and writable mappings
    are refused by the kernel (future-write seal), so bytes a reader verified stay what it verified."""
    s = ArenaStore(1 << 20)
    c = chunk(5)
    assert s.put(c)
    fd = os.open(f"/proc/{os.getpid()}/fd/{s.arena.fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, s.arena.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    assert same(s.get(c.key), c)


def test_the_store_copies_entries_into_its_arena_and_hands_out_where_they_lie():
    s = ArenaStore(1 << 20)
    c = chunk(1)
    assert s.put(c) and s.stats()["entries"] == 1
    h = s.get_handle(c.key)
    assert h is not None and h.arena == s.arena.ref and h.offset % PAGE == 0
    view = ArenaMaps().view(h.arena, h.offset, h.length)
    assert same(KVChunk.from_bytes(view, s.secret.mac_key, share=True), c)
    assert same(s.get(c.key), c) and s.get_handle("f" * 64) is None


def test_a_slot_handed_out_is_reused_only_after_the_readers_deadline():
    """The invariant the reader relies on: an evicted entry's slot holds other bytes only once the hold of its
    last hand-out has passed, and by then every reader of that hand-out sees its chunk as stale."""
    s = ArenaStore(3500, slack_bytes=0, hold_s=arena.READER_MARGIN_S + 2.0)  # 2 s: past a loaded machine's pause
    a = chunk(1, tokens=4)
    n = len(a.to_bytes(s.secret.mac_key))
    assert n < 3500 < 2 * n and s.put(a)
    maps = ArenaMaps()
    view = maps.view(*_handle_parts(s.get_handle(a.key)))
    got = KVChunk.from_bytes(view, s.secret.mac_key, share=True)
    got.lease = Lease(time.monotonic() + 2.0, None)  # the client's clock half: hold less its margin, from receipt
    b = chunk(2, tokens=4)
    assert s.remove(a.key)  # gone while its hand-out's hold lasts: its slot is held
    assert s.put_bytes(b.key, b.to_bytes(s.secret.mac_key)) is PutResult.REFUSED
    assert s.stats()["arena_refused"] == 1 and not s.contains(a.key) and got.fresh()
    time.sleep(2.05)
    assert not got.fresh()
    time.sleep(arena.READER_MARGIN_S)
    assert s.put(b)  # the slot is free now, and b lies where a did
    assert not torch.equal(got.target_kv, a.target_kv)  # what the stale view shows now is b's bytes


def _handle_parts(h):
    return h.arena, h.offset, h.length


def test_an_evicted_unheld_slot_is_reused_at_once():
    s = ArenaStore(3500, slack_bytes=0)
    a, b = chunk(1, tokens=4), chunk(2, tokens=4)
    assert s.put(a) and s.put(b) and not s.contains(a.key) and s.contains(b.key)


def _frame(ref: ArenaRef, offset: int, length: int, hold_ms: int = 30_000, gen: tuple[int, int] = (0, 0)) -> Frame:
    return Frame(key="k" * 64, offset=0, total_length=length, last=True,
                 shm=ShmRef(length=length, arena_pid=ref.pid, arena_fd=ref.fd, arena_inode=ref.inode,
                            arena_size=ref.size, offset=offset, hold_ms=hold_ms, gen_offset=gen[0], gen=gen[1]))


def test_the_client_maps_only_the_sealed_arena_the_handle_names():
    a = Arena(4 * PAGE)
    maps = ArenaMaps()
    ok = _in_arena(_frame(a.ref, PAGE, 100, gen=a.generation(PAGE)), 1 << 20, maps)
    assert len(ok.data) == 100 and ok.data.readonly and ok.lease.valid()
    bad = {
        "another file at that descriptor number": replace(a.ref, inode=a.ref.inode + 1),
        "another size": replace(a.ref, size=a.ref.size + PAGE),
        "a descriptor the process does not have": replace(a.ref, fd=1 << 20),
        "a process that does not exist": replace(a.ref, pid=(1 << 22) + 1),
    }
    for why, ref in bad.items():
        with pytest.raises(ArenaError):
            ArenaMaps().view(ref, 0, 100)
    for off, n in ((a.size - 50, 100), (0, 0), (a.size, 1)):
        with pytest.raises(ArenaError, match="outside"):
            maps.view(a.ref, off, n)


def test_the_client_refuses_an_unsealed_memfd_that_could_shrink_under_it():
    """A mapping of a file that shrinks faults (SIGBUS, the reader dies): only a memfd sealed against shrinking
    is ever mapped."""
    fd = os.memfd_create("not-an-arena", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4 * PAGE)
        ref = ArenaRef(os.getpid(), fd, os.fstat(fd).st_ino, 4 * PAGE)
        with pytest.raises(ArenaError, match="not sealed"):
            ArenaMaps().view(ref, 0, 100)
    finally:
        os.close(fd)


def test_a_handle_whose_hold_leaves_no_time_to_read_is_refused():
    a = Arena(4 * PAGE)
    with pytest.raises(Exception, match="hold_ms"):
        _in_arena(_frame(a.ref, 0, 100, hold_ms=int(arena.READER_MARGIN_S * 1000)), 1 << 20, ArenaMaps())
    with pytest.raises(Exception, match="length"):
        _in_arena(_frame(a.ref, 0, 2 << 20), 1 << 20, ArenaMaps())


def test_a_get_through_the_arena_reads_in_place_and_writes_no_segment():
    server, port = serve(ArenaStore(64 << 20))
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as c:
            cs = [chunk(i, parent=chunk(i - 1).key if i else "") for i in range(4)]
            assert c.put(cs, "arena").stored == 4
            before = shm.list_segments()
            got = c.get([x.key for x in cs], "arena")
            assert all(same(g, x) and g.fresh() and g.lease is not None for g, x in zip(got, cs))
            st = c.stats()
            assert st["server.arena_handles_sent"] == 4 and st["server.shm_segments_sent"] == 0
            assert shm.list_segments() == before
            # the same bridge, asked for segments, writes them as before
            got = c.get([x.key for x in cs], "shm")
            assert all(same(g, x) and g.lease is None for g, x in zip(got, cs))
            assert c.stats()["server.shm_segments_sent"] == 4
    finally:
        server.stop(grace=None).wait(10)


def test_an_entry_corrupted_in_the_arena_is_refused_by_the_reader_and_dropped_by_the_bridge():
    """The bridge hands out where an entry lies without verifying it again (it was verified when put; only the
    bridge's mapping can write the arena): the reader's MAC over the mapped bytes is what refuses a changed one, and
    the reader then has the bridge check it and drop it (else, kept fresh by every failed read, it would fail every
    Get of its prompt until the bridge restarted)."""
    store = ArenaStore(64 << 20)
    server, port = serve(store)
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as c:
            cs = [chunk(i, parent=chunk(i - 1).key if i else "") for i in range(3)]
            assert c.put(cs, "arena").stored == 3
            h = store.get_handle(cs[1].key)
            store.arena._array[h.offset + h.length // 2] ^= 0x40  # one bit, through the bridge's own mapping
            got = c.get([x.key for x in cs], "arena")  # the run ends before it: those positions are recomputed
            assert len(got) == 1 and same(got[0], cs[0])
            # and the reader had the bridge verify it and drop it, so it fails no later Get; a good copy goes back
            assert not store.contains(cs[1].key) and store.stats()["corrupt_dropped"] == 1
            assert c.put([cs[1]], "arena").stored == 1
            assert all(same(g, x) for g, x in zip(c.get([x.key for x in cs], "arena"), cs))
    finally:
        server.stop(grace=None).wait(10)


def test_an_arena_get_from_a_bridge_without_an_arena_gets_segments():
    server, port = serve(MemoryStore(64 << 20))
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as c:
            x = chunk(3)
            c.put([x], "arena")
            (g,) = c.get([x.key], "arena")
            assert same(g, x) and g.lease is None and c.stats()["server.shm_segments_sent"] == 1
    finally:
        server.stop(grace=None).wait(10)


def test_a_launched_arena_bridge_is_read_in_place_from_another_process(dflash_pair, tmp_path):  # noqa: F811
    """The real same-host case: `bridge_transport: arena` gives the bridge worker (its own process, started by the
    local launcher) an arena memory tier; this process opens it through /proc/<pid>/fd and reads what another
    client put, in place."""
    from flashpd.cluster.launcher import WorkerSpec
    from flashpd.cluster.local_launcher import LocalLauncher
    from tests._cluster_helpers import serve_cfg

    launcher = LocalLauncher(tmp_path / "logs")
    try:
        (w,) = launcher.start([WorkerSpec("bridge", 0, serve_cfg(dflash_pair, "local", bridge_transport="arena"))],
                              120.0)
        with BridgeClient(w.address, 30, secret=launcher.secret) as writer, \
                BridgeClient(w.address, 30, secret=launcher.secret) as reader:
            assert reader.health()["store"] == "ArenaStore"
            cs = [chunk(10 + i) for i in range(3)]
            assert writer.put(cs, "inline").stored == 3
            got = reader.get([x.key for x in cs], "arena")
            assert all(same(g, x) and g.lease is not None for g, x in zip(got, cs))
            assert reader.stats()["server.arena_handles_sent"] == 3
    finally:
        launcher.shutdown()


def test_a_disk_hit_is_promoted_into_the_arena_and_handed_out_from_there(tmp_path):
    from flashpd.kv_bridge.disk import DiskStore, TieredStore
    cs = [chunk(20 + i) for i in range(2)]
    first = TieredStore(ArenaStore(1 << 20), DiskStore(tmp_path / "kv", 1 << 20))
    assert all(first.put(c) for c in cs) and first.flush(10)
    first.close()
    again = TieredStore(ArenaStore(1 << 20), DiskStore(tmp_path / "kv", 1 << 20))  # a restart: memory empty
    server, port = serve(again)
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as c:
            got = c.get([x.key for x in cs], "arena")
            assert all(same(g, x) for g, x in zip(got, cs)) and c.stats()["server.arena_handles_sent"] == 2
            assert again.stats()["hits_disk"] == 2 and again.memory.stats()["entries"] == 2
    finally:
        server.stop(grace=None).wait(10)
        again.close()
    plain = TieredStore(MemoryStore(1 << 20), DiskStore(tmp_path / "kv2", 1 << 20))
    assert not hasattr(plain, "get_handle")  # no arena below it: a bridge sends segments
    plain.close()


def test_a_handle_naming_another_file_fails_the_get_loudly():
    """A handle the client cannot map is a protocol error of that Get (the caller recomputes), never a crash."""
    a = Arena(4 * PAGE)
    with pytest.raises(BridgeProtocolError, match="not the arena"):
        BridgeClient._receive(_frame(replace(a.ref, inode=a.ref.inode + 7), 0, 100), Assembler(), 1 << 20, ArenaMaps())


def test_a_readers_view_of_the_arena_is_read_only():
    a = Arena(4 * PAGE)
    view = ArenaMaps().view(a.ref, 0, 100)
    with pytest.raises(TypeError):
        view[0] = 1


@pytest.mark.parametrize("tier", ["host", "device"])
def test_a_worker_tier_never_keeps_a_chunk_read_past_its_hold(tier):
    """A chunk read in place from an arena whose deadline has passed is not promoted into a worker's tier: what
    it copied may be another chunk's bytes."""
    from flashpd.kv_bridge.device_store import DeviceStore
    from flashpd.kv_bridge.host_store import HostStore
    store = HostStore(1 << 20, "cpu") if tier == "host" else DeviceStore(1 << 20, "cpu")
    late, ok = chunk(1), chunk(2)
    late.lease, ok.lease = Lease(time.monotonic() - 0.01), Lease(time.monotonic() + 30)
    assert not store.put(late) and store.put(ok)
    st = store.stats()
    assert st["stale_refused"] == 1 and st["entries"] == 1 and store.get(late.key) is None


def test_every_read_holds_the_slot_and_only_copies_leave_without_a_deadline():
    """An inline or segment Get streams (or writes out) what get_bytes returned, for as long as its client takes:
    a copy, never a view of a slot that may be reused. A shared read's views carry the reader's deadline. And a
    slot read any way is held, so it is not reused while the read is still copying or verifying."""
    s = ArenaStore(3500, slack_bytes=0)
    a, b = chunk(1, tokens=4), chunk(2, tokens=4)
    assert s.put(a)
    data = s.get_bytes(a.key)
    assert isinstance(data, bytes) and same(KVChunk.from_bytes(data, s.secret.mac_key), a)
    shared = s.get_shared(a.key)
    assert same(shared, a) and shared.fresh() and shared.lease.expires_at < time.monotonic() + s.hold_s
    assert not s.put(b) and s.stats()["arena_refused"] == 1  # a evicted for b, its slot held by those reads


@pytest.mark.parametrize("transport", ["inline", "arena"])
def test_a_put_lands_in_its_arena_slot_with_no_copy_of_its_own(transport):
    """The frames (inline) or the segment (same host) are read straight into the slot the entry will live in; a
    chunk refused (a duplicate, a corrupt one) gives its reserved slot back."""
    store = ArenaStore(64 << 20)
    server, port = serve(store)
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as c:
            cs = [chunk(30 + i) for i in range(3)]
            assert c.put(cs, transport).stored == 3
            assert store.stats()["filled_in_place"] == 3
            assert all(same(g, x) for g, x in zip(c.get([x.key for x in cs], "arena"), cs))
            assert c.put(cs[:1], transport).duplicates == 1
            bad = chunk(40)
            data = bytearray(bad.to_bytes(store.secret.mac_key))
            data[-1] ^= 1
            assert c.put_bytes([(bad.key, bytes(data))], transport).refused == 1
            assert store.stats()["filled_in_place"] == 3 and store.stats()["entries"] == 3
        used = sum(_round(len(x.to_bytes(store.secret.mac_key))) for x in cs)
        store.stats()  # (slots of lent buffers that died are freed by the next reserve, put or stats)
        assert store.arena.alloc(store.arena.data_size - used) is not None  # the refused chunks' slots came back
    finally:
        server.stop(grace=None).wait(10)


def _round(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def test_a_handle_that_arrives_after_its_slot_was_reused_is_stale_whatever_the_readers_clock_says():
    """The reader's clock counts from when a handle reached it; one that waited in a buffer longer than the margin
    would trust a slot the bridge already reused. The slot's generation word catches that: bumped before reuse."""
    s = ArenaStore(3500, slack_bytes=0, hold_s=arena.READER_MARGIN_S + 0.5)
    a, b = chunk(1, tokens=4), chunk(2, tokens=4)
    assert s.put(a)
    h = s.get_handle(a.key)  # sent now...
    time.sleep(arena.READER_MARGIN_S + 0.6)  # ...delivered late: the bridge's hold has passed
    assert s.put(b) and not s.contains(a.key)  # a evicted, b in its slot
    late = _in_arena(Frame(key=a.key, offset=0, total_length=h.length, last=True, shm=ShmRef(
        length=h.length, arena_pid=h.arena.pid, arena_fd=h.arena.fd, arena_inode=h.arena.inode, arena_size=h.arena.size,
        offset=h.offset, hold_ms=int(h.hold_s * 1000), gen_offset=h.gen_offset, gen=h.gen)), 1 << 20, ArenaMaps())
    assert late.lease.expires_at > time.monotonic()  # the clock alone would trust it
    assert not late.lease.valid()  # the word says the slot is not a's any more
    now = s.get_handle(b.key)
    assert now.offset == h.offset and now.gen == h.gen + 1


def test_a_device_tier_on_the_cpu_copies_an_arena_chunk_rather_than_keep_its_views():
    """to() on the tensors' own device returns them as they are: a CPU device tier kept views of the bridge's arena,
    whose slot later held another chunk (no lease on the kept entry). It copies such a chunk."""
    from flashpd.kv_bridge.device_store import DeviceStore
    s = ArenaStore(1 << 20)
    c = chunk(7)
    assert s.put(c)
    shared = s.get_shared(c.key)
    assert shared.lease is not None
    tier = DeviceStore(1 << 20, "cpu")
    assert tier.put(shared)
    kept = tier.get(c.key)
    assert kept.lease is None and same(kept, c)
    assert kept.target_kv.data_ptr() != shared.target_kv.data_ptr()
    assert kept.draft_kv.data_ptr() != shared.draft_kv.data_ptr()


def test_a_put_evicts_more_to_find_a_slot_where_free_room_is_in_pieces():
    """Entries of different sizes (a native entry has no drafter half) leave free room in pieces: a larger entry
    finds no slot though the budget has room. It evicts further (least recently used first) until one frees up."""
    small = [chunk(50 + i, tokens=4) for i in range(6)]
    n_small = _round(len(small[0].to_bytes(ArenaStore(1 << 16).secret.mac_key)))
    s = ArenaStore(6 * n_small, slack_bytes=0)
    assert all(s.put(x) for x in small)
    for x in small[1::2]:  # every other one gone: free room in pieces of one slot
        assert s.remove(x.key)
    big = chunk(60, tokens=12)
    assert _round(len(big.to_bytes(s.secret.mac_key))) > n_small
    assert s.put(big) and s.stats()["arena_refused"] == 0
    assert not s.contains(small[0].key) and s.contains(small[4].key)


def test_a_store_that_is_dropped_is_collected_and_closes_its_arena():
    """A lent buffer's finalizer holds no reference to its store: a store with entries received in place is
    collected like any other, and its arena's descriptor goes with it."""
    import gc
    s = ArenaStore(1 << 20)
    _wait(lambda: s.arena.populated == s.arena.data_size)  # its populating thread holds the arena a step at a time
    c = chunk(70)
    data = c.to_bytes(s.secret.mac_key)
    buf = s.reserve(len(data))
    buf[:] = memoryview(data)
    assert s.put_bytes(c.key, memoryview(buf).toreadonly()) is PutResult.STORED
    assert s.stats()["filled_in_place"] == 1
    ref, fd, inode = weakref.ref(s), s.arena.fd, s.arena.ref.inode
    del s, buf
    gc.collect()
    assert ref() is None
    try:  # the descriptor is closed (its number may name another file by now)
        assert os.fstat(fd).st_ino != inode
    except OSError:
        pass


def test_puts_in_flight_borrow_at_most_half_the_slack():
    """Slots lent to Puts still arriving (a slow client's) must not take the room evicted entries' held slots wait
    in: past half the slack a receiver uses memory of its own, and a lent buffer that dies gives its share back."""
    s = ArenaStore(1 << 20, slack_bytes=8 * PAGE)
    a = s.reserve(2 * PAGE)
    b = s.reserve(2 * PAGE)
    assert a is not None and b is not None and s.reserve(1) is None
    del a
    assert s.reserve(2 * PAGE) is not None  # (the one just made dies at once, as a stream cut would leave it)


def test_a_loan_that_dies_while_another_is_made_frees_its_own_slot_only():
    """A lent buffer dropped by one thread while another is between a drain and a new loan: the new buffer can be
    given the dead one's id at once. Loans known by id() then lost the dead one's slot for good and later freed the
    live one's, which a third loan got while the second was still being written (two chunks in one slot)."""
    s = ArenaStore(1 << 20, slack_bytes=16 * PAGE)
    lent = {"x": s.reserve(PAGE)}
    alloc = s.arena.alloc

    def alloc_while_another_thread_drops_its_loan(n: int) -> int | None:
        lent.pop("x", None)
        return alloc(n)

    s.arena.alloc = alloc_while_another_thread_drops_its_loan
    b = s.reserve(PAGE)
    s.arena.alloc = alloc
    s.stats()  # the dead loan's slot is freed here
    c = s.reserve(PAGE)
    address = lambda a: a.__array_interface__["data"][0]  # noqa: E731
    assert address(c) != address(b)
    del b, c
    s.stats()
    assert s.arena.alloc(s.arena.data_size) == 0  # every loan's slot came back


def test_a_put_does_not_evict_entries_whose_slots_a_read_still_holds_for_nothing():
    """Evicting an entry read within its hold frees no room now (its slot waits out the hold): a put that finds no
    slot does not throw such entries away beyond what the budget needs; it is refused and they stay."""
    small = [chunk(80 + i, tokens=4) for i in range(6)]
    n_small = _round(len(small[0].to_bytes(ArenaStore(1 << 16).secret.mac_key)))
    s = ArenaStore(6 * n_small, slack_bytes=0)
    assert all(s.put(x) for x in small)
    for x in small[1::2]:
        assert s.remove(x.key)
    assert all(s.get_handle(x.key) is not None for x in small[0::2])  # all read: held if evicted
    big = chunk(90, tokens=12)
    assert not s.put(big) and s.stats()["arena_refused"] == 1
    assert all(s.contains(x.key) for x in small[0::2])


def test_a_put_refused_for_want_of_a_slot_evicts_nothing():
    """Every entry read within its hold and the arena full: the budget's evictions could free no room before the
    holds end, so the put is refused before evicting. It used to evict entries first, then find no slot: a client
    reading hot entries shrank the store while its puts failed."""
    small = [chunk(60 + i, tokens=4) for i in range(4)]
    n_small = _round(len(small[0].to_bytes(ArenaStore(1 << 16).secret.mac_key)))
    s = ArenaStore(4 * n_small, slack_bytes=0)
    assert all(s.put(x) for x in small)
    assert all(s.get_handle(x.key) is not None for x in small)  # all read: each slot held if evicted
    for i in range(3):
        assert not s.put(chunk(70 + i, tokens=4))
    st = s.stats()
    assert (st["arena_refused"], st["evictions"], st["entries"]) == (3, 0, 4)
    assert all(s.contains(x.key) for x in small)


class RecordingPinner:
    """Stands in for CudaPinner (no GPU here): records what it is asked, and checks that a range it unregisters
    is still mapped (unmapping a range before the driver lets go of it would be the bug)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.events: list[tuple[str, int, int]] = []
        self.still_mapped_at_unregister: list[bool] = []
        self.maps: ArenaMaps | None = None

    def register(self, addr: int, n: int) -> None:
        self.events.append(("register", addr, n))
        if self.fail:
            raise ArenaError("no CUDA here")

    def unregister(self, addr: int) -> None:
        self.events.append(("unregister", addr, 0))
        assert self.maps is not None
        m = next(m for m in self.maps._dropped_all if m.addr == addr)
        self.still_mapped_at_unregister.append(not m.mm.closed)


def _pinned_maps(p: RecordingPinner) -> ArenaMaps:
    maps = ArenaMaps(p)
    p.maps = maps
    maps._dropped_all = []  # every mapping made, for the pinner's check
    orig = maps._mapping

    def mapping(ref):
        m = orig(ref)
        if m not in maps._dropped_all:
            maps._dropped_all.append(m)
        return m

    maps._mapping = mapping
    return maps


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_pinning_reader_page_locks_each_arena_once_whole_and_unregisters_before_unmapping():
    p = RecordingPinner()
    maps = _pinned_maps(p)
    arenas = [Arena(4 * PAGE) for _ in range(arena.MAX_MAPPED + 3)]
    view = maps.view(arenas[0].ref, PAGE, 100)
    maps.view(arenas[0].ref, 0, 10)
    _wait(lambda: maps.stats()["pinned"] == 1)
    first = maps._dropped_all[0]
    assert p.events == [("register", first.addr, arenas[0].size)]  # the whole mapping, once
    for a in arenas[1:arena.MAX_MAPPED + 2]:  # the first drops out of the reader's MAX_MAPPED; a view of it lives
        maps.view(a.ref, 0, 10)
    _wait(lambda: maps.stats()["pinned"] == arena.MAX_MAPPED)
    time.sleep(2.5 * arena.TICK_S)  # new mappings and the pinning thread's ticks reap: this one is still viewed
    assert maps.stats()["dropped_viewed"] == 1 and not first.mm.closed and first.pinned
    assert ("unregister", first.addr, 0) not in p.events
    assert bytes(view) == bytes(100)  # still readable
    del view
    maps.view(arenas[1 + arena.MAX_MAPPED].ref, 0, 10)  # any use reaps the dropped ones nothing views
    _wait(lambda: first.mm.closed)
    assert ("unregister", first.addr, 0) in p.events and all(p.still_mapped_at_unregister)
    maps.close()  # the rest: unregistered, then unmapped, on the pinning thread, which then stops
    _wait(lambda: all(m.mm.closed for m in maps._dropped_all) and maps._jobs is None)
    unreg = [e for e in p.events if e[0] == "unregister"]
    assert len(unreg) == len(maps._dropped_all) and all(p.still_mapped_at_unregister)
    assert not any(m in arena._REGISTERED for m in maps._dropped_all)


def test_a_reader_closed_while_a_chunk_is_still_viewed_unmaps_it_once_the_view_is_gone():
    p = RecordingPinner()
    maps = _pinned_maps(p)
    a = Arena(4 * PAGE)
    view = maps.view(a.ref, 0, 64)
    _wait(lambda: maps.stats()["pinned"] == 1)
    m = maps._dropped_all[0]
    maps.close()
    time.sleep(1.5 * arena.TICK_S)
    assert not m.mm.closed and m.pinned and m in arena._REGISTERED and bytes(view) == bytes(64)
    del view  # the pinning thread's next tick finds it unviewed: unregistered, then unmapped, then the thread ends
    _wait(lambda: m.mm.closed and maps._jobs is None)
    assert p.events[-1] == ("unregister", m.addr, 0) and p.still_mapped_at_unregister == [True]
    assert m not in arena._REGISTERED


def test_a_reader_that_cannot_page_lock_reads_as_before_and_warns_once(caplog):
    p = RecordingPinner(fail=True)
    maps = _pinned_maps(p)
    a, b = Arena(4 * PAGE), Arena(4 * PAGE)
    with caplog.at_level("WARNING", logger="flashpd.kv_bridge.arena"):
        v = maps.view(a.ref, 0, 16)
        maps.view(b.ref, 0, 16)
        _wait(lambda: len(p.events) == 2)
        assert bytes(v) == bytes(16) and maps.stats() == {"mapped": 2, "pinned": 0, "pin_failed": 2,
                                                          "dropped_viewed": 0}
        maps.close()
        del v
        _wait(lambda: maps._jobs is None and all(m.mm.closed for m in maps._dropped_all))
    assert len([r for r in caplog.records if "page-locked" in r.getMessage()]) == 1
    assert all(e[0] == "register" for e in p.events)  # nothing registered: nothing to unregister


def test_a_mapping_dropped_unviewed_is_unmapped_without_a_pinner():
    maps = ArenaMaps()
    arenas = [Arena(4 * PAGE) for _ in range(arena.MAX_MAPPED + 1)]
    w = maps.word(arenas[0].ref, arenas[0].generation(0)[0])  # a generation word is a view too
    first = maps._maps[arenas[0].ref]
    for a in arenas[1:]:
        maps.view(a.ref, 0, 8)
    assert not first.mm.closed and maps.stats()["dropped_viewed"] == 1
    del w
    maps.view(arenas[-1].ref, 0, 8)  # a mapping reused: the dropped one nothing views is unmapped
    assert first.mm.closed and maps.stats() == {"mapped": arena.MAX_MAPPED, "pinned": 0, "pin_failed": 0,
                                                "dropped_viewed": 0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking for a GPU needs CUDA")
def test_a_cuda_pinned_arena_copies_to_the_gpu_as_page_locked_memory():
    s = ArenaStore(1 << 22)
    c = chunk(3, tokens=64)
    assert s.put(c)
    h = s.get_handle(c.key)
    maps = ArenaMaps(arena.CudaPinner())
    view = maps.view(h.arena, h.offset, h.length)
    _wait(lambda: maps.stats()["pinned"] == 1)
    got = KVChunk.from_bytes(view, s.secret.mac_key, share=True)
    assert got.target_kv.is_pinned()
    assert torch.equal(got.target_kv.to("cuda").cpu(), c.target_kv)
    del got, view
    maps.close()
    _wait(lambda: maps._jobs is None and maps.stats()["mapped"] == 0)


def test_the_arena_is_faulted_in_ahead_of_puts_without_changing_a_byte():
    """A fresh slot's first write costs a fault, an allocation and zeroing (a chunk received into fresh slots ran at
    a fifth of the rate): the store faults the arena in on a thread of its own, while puts already land in it."""
    s = ArenaStore(3 * arena.POPULATE_STEP, slack_bytes=0)
    cs = [chunk(80 + i, tokens=64) for i in range(8)]
    assert all(s.put(c) for c in cs)  # racing the populating thread
    _wait(lambda: s.stats()["arena_populated_bytes"] == s.arena.data_size)
    assert all(same(s.get(c.key), c) for c in cs)
    resident = _resident_bytes(s.arena)
    assert resident >= s.arena.data_size, resident
    assert ArenaStore(3 * arena.POPULATE_STEP, slack_bytes=0, populate=False).stats()["arena_populated_bytes"] == 0


def _resident_bytes(a: Arena) -> int:
    """Bytes of the arena's mapping resident in this process (its line in /proc/self/smaps)."""
    start = a._array.ctypes.data
    lines = open("/proc/self/smaps").read().splitlines()
    for i, ln in enumerate(lines):
        if ln.split("-")[0] == f"{start:x}":
            for more in lines[i + 1:i + 20]:
                if more.startswith("Rss:"):
                    return int(more.split()[1]) * 1024
    raise AssertionError("the arena's mapping is not in /proc/self/smaps")


def test_a_dead_bridges_arena_is_unmapped_when_another_arena_is_mapped():
    """A bridge that died (restarted: a new process, a new arena) left its whole arena held in memory by each
    client's mapping, up to MAX_MAPPED - 1 of them a client. Mapping a new arena drops the mappings of arenas whose
    process is gone (unmapped at once when nothing views them)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = ("import sys; from flashpd.kv_bridge.arena import Arena, PAGE; a = Arena(4 * PAGE); "
            "print(a.ref.pid, a.ref.fd, a.ref.inode, a.ref.size, flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        dead = ArenaRef(*map(int, p.stdout.readline().split()))
        maps = ArenaMaps()
        maps.view(dead, 0, 8)  # mapped, the view dropped at once
        first = maps._maps[dead]
        p.stdin.close()
        p.wait(30)
        live = Arena(4 * PAGE)
        maps.view(live.ref, 0, 8)
        assert dead not in maps._maps and first.mm.closed
        assert maps.stats() == {"mapped": 1, "pinned": 0, "pin_failed": 0, "dropped_viewed": 0}
        maps.close()
    finally:
        if p.poll() is None:
            p.kill()


def _node_address() -> str | None:
    """One of this host's own non-loopback IPv4 addresses (what Ray advertises as a node's), if it has one."""
    import socket

    import psutil
    ips = sorted(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127."))
    return ips[0] if ips else None


@pytest.mark.skipif(_node_address() is None, reason="this host has no non-loopback IPv4 address to dial")
def test_a_same_host_client_dialing_the_node_address_gets_shm_and_arena():
    """With allow_remote, workers dial the bridge at its node's address, so a same-host worker arrives from that
    address, not loopback: the bridge refused it shm and arena on every call ("shared memory needs a same-host
    client"), and every request recomputed its prompt. One of this host's own addresses is this host."""
    server, port = serve(ArenaStore(64 << 20), "0.0.0.0", allow_remote=True)
    try:
        with BridgeClient(f"{_node_address()}:{port}", timeout_s=30) as c:
            cs = [chunk(i, parent=chunk(i - 1).key if i else "") for i in range(4)]
            assert c.put(cs[:2], "shm").stored == 2 and c.put(cs[2:], "arena").stored == 2
            assert all(same(g, x) for g, x in zip(c.get([x.key for x in cs], "arena"), cs))
            assert all(same(g, x) for g, x in zip(c.get([x.key for x in cs], "shm"), cs))
            st = c.stats()
            assert st["server.arena_handles_sent"] == 4 and st["server.shm_segments_sent"] == 4
    finally:
        server.stop(grace=None).wait(10)


def test_only_loopback_and_this_hosts_own_addresses_are_same_host_peers():
    from flashpd.kv_bridge.server import _peer_is_local
    assert _peer_is_local("ipv4:127.0.0.1:5000") and _peer_is_local("ipv6:[::1]:5000") and _peer_is_local("unix:/x")
    assert _peer_is_local("ipv6:%5B::ffff:127.0.0.1%5D:5000")  # a dual-stack socket's IPv4 peer, as gRPC quotes it
    assert not _peer_is_local("ipv4:198.51.100.7:5000")  # TEST-NET-2: no host's own
    assert not _peer_is_local("dns:bridge:5000")
    node = _node_address()
    if node is not None:
        assert _peer_is_local(f"ipv4:{node}:5000")

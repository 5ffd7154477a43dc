"""A worker's host tier: cache entries kept as tensors in pinned host memory, restored at PCIe speed.

Why not the MemoryStore: it keeps serialised bytes, so a hit pays a MAC over the whole chunk and a
pageable host-to-device copy, several times this tier's restore (docs/results.md). Here an entry is the chunk's two
tensors in a slot of a pinned arena: a put is one asynchronous device-to-host DMA on a side
stream, a hit is one asynchronous host-to-device DMA per chunk on the reader's stream, and the
PrefixCache then writes that device copy into the paged caches.

No MAC in this tier, for the device tier's reason: its tensors never leave the process and are
never serialised, so nothing in transit can be corrupted or forged; pinned host memory of this
process is the same trust domain as the GPU memory it mirrors. Every read is still checked
against the reader's layout (geometry, dtype, token count, method fingerprint, drafter half)
before anything is copied: a mismatch is a counted miss (get() raises LayoutMismatch, the Store
protocol's signal; get_many() ends its run there). A `backing` store verifies its own MACs before
anything from it is promoted here.

Memory: one arena of fixed-size slots (one chunk a slot; the chunks of one service have one
size), carved from a few large buffers that are allocated when the arena grows, never per put or
get (cudaHostAlloc is slow); `reserve()` allocates them all up front. The buffers together never
take more host memory than the byte budget. Entries are evicted least recently used when no slot
is free and the budget allows no further buffer.

Ordering on CUDA, without host syncs: a put's copy waits (on the side stream) for the stream that
produced the chunk and records a `ready` event; a read makes the reader's stream wait for that
event, so it never sees a half-written slot; every read records an event that the next write
into the same slot waits for, so a slot is never overwritten under a copy still reading it.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from flashpd.kv_bridge.chunk import KVChunk, LayoutMismatch
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.lru import ChainLRU
from flashpd.kv_bridge.store import freshen, leading, leading_gets, may_evict, protected, put_through

ALIGN = 256  # slot and draft-half offsets: any dtype view is aligned, and DMA starts on a good boundary
SEGMENT_BYTES = 1 << 30  # the largest single host allocation: bounds the stall when the arena grows


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _Arena:
    """Fixed-size slots carved from large host buffers (pinned for a CUDA store), which together never
    take more than the byte budget. Pinned segments are a power of two bytes, because the CUDA host
    allocator rounds every request up to one: a segment of exactly that size wastes only the
    remainder after its last slot."""

    def __init__(self, slot_bytes: int, byte_budget: int, pinned: bool) -> None:
        self.stride = _align(slot_bytes) + ALIGN  # room for the pad before the draft half
        self.byte_budget = byte_budget
        self.pinned = pinned
        self.slots: list[torch.Tensor] = []
        self.free: list[int] = []
        self.full = False  # the budget holds no further segment
        self.allocations = 0
        self.host_bytes = 0

    def take(self) -> int | None:
        """A free slot, growing the arena by one segment when none is free; None when it is full."""
        if not self.free and not self.full:
            self.grow()
        return self.free.pop() if self.free else None

    def grow(self) -> bool:
        """Add one segment's slots; False when the budget holds no more."""
        one = 1 << (self.stride - 1).bit_length() if self.pinned else self.stride  # what a lone slot takes
        size = min(self.byte_budget - self.host_bytes, max(SEGMENT_BYTES, one))
        if self.pinned and size > 0:
            size = 1 << (size.bit_length() - 1)
        n = max(size, 0) // self.stride
        if n == 0:
            self.full = True
            return False
        seg = torch.empty(size if self.pinned else n * self.stride, dtype=torch.uint8, pin_memory=self.pinned)
        self.allocations += 1
        self.host_bytes += seg.numel()
        first = len(self.slots)
        self.slots += [seg[i * self.stride:(i + 1) * self.stride] for i in range(n)]
        self.free += range(first + n - 1, first - 1, -1)  # popped lowest first: the segment fills in order
        return True


@dataclass
class _Entry:
    chunk: KVChunk  # its tensors are views of the slot: shapes and dtypes for the layout check
    slot: int
    draft_at: int  # byte offset of the draft half in the slot
    used: int  # bytes of the slot the chunk occupies (target, pad, draft): what a read copies
    ready: torch.cuda.Event | None  # the put's copy; None once known complete, and on the CPU


class HostStore:
    """put/get/get_many/contains/lookup/stats of the Store protocol over a pinned arena.

    slot_bytes: the largest chunk's tensor bytes (ChunkLayout.payload_bytes() of the service's full,
    both-halves chunks). Left out, the first put sizes the slots; a later, larger chunk is then
    refused (counted) and only written through to `backing`, so a service whose first put may be a
    smaller, target-only chunk passes it. The chunks given to put must not be written afterwards
    (PrefixCache.publish hands over fresh tensors): their copy may still be running."""

    def __init__(self, byte_budget: int, device: str | torch.device, backing=None,
                 slot_bytes: int | None = None) -> None:
        if byte_budget <= 0:
            raise ValueError("byte_budget must be positive")
        self.byte_budget = byte_budget
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.backing = backing
        self._cuda = device.type == "cuda"
        self._arena = _Arena(slot_bytes, byte_budget, self._cuda) if slot_bytes else None
        self._entries: ChainLRU[_Entry] = ChainLRU()
        self._fences: dict[int, dict[int, torch.cuda.Event]] = {}  # slot -> {stream: its last copy of it}
        # made now: the first stream a process makes waits for the whole device, a stall no put should take
        self._side = torch.cuda.Stream(device) if self._cuda else None
        self._bytes = 0
        self._lock = threading.Lock()
        self._c = dict(puts=0, duplicate_puts=0, hits=0, hits_backing=0, misses=0, evictions=0, layout_refused=0,
                       oversize_refused=0, waits=0, chain_refused=0, stale_refused=0)

    # -- writes ---------------------------------------------------------------------------------
    def put(self, chunk: KVChunk) -> bool:
        """Keep the chunk here (one asynchronous copy into a slot) and in the backing store."""
        stored = self._keep(chunk)
        backed = self.backing.put(chunk) if self.backing is not None else False
        return stored or backed

    def put_many(self, chunks: list[KVChunk]) -> int:
        """put() of a prompt's chunks, the backing store's part in one call (store.put_through)."""
        return put_through(self._keep, self.backing, chunks)

    def reserve(self) -> int:
        """Allocate the whole arena now (at startup), so no put ever waits for a host allocation.
        Returns the number of slots; needs slot_bytes (or a first put)."""
        with self._lock:
            if self._arena is None:
                raise ValueError("reserve() needs slot_bytes: the arena is sized by its chunks")
            while self._arena.grow():
                pass
            return len(self._arena.slots)

    def _freshen(self, key: str) -> None:
        """(lock held) The entry, then its prompt's held chunks before it, become the most recent: eviction
        takes a prompt's tail first (store.freshen)."""
        freshen(self._entries, key, lambda k: self._entries[k].chunk.parent)

    def _keep(self, chunk: KVChunk) -> bool:
        tb, db = _nbytes(chunk.target_kv), _nbytes(chunk.draft_kv)
        draft_at = _align(tb)
        used = draft_at + db
        with self._lock:  # the copy is queued under the lock: a reader never finds a slot not yet fenced
            if chunk.key in self._entries:  # first writer wins: an entry never changes under a reader
                self._freshen(chunk.key)
                self._c["duplicate_puts"] += 1
                return False
            if self._arena is None:
                self._arena = _Arena(tb + db, self.byte_budget, self._cuda)
            self._freshen(chunk.parent)  # its prompt's earlier chunks are not what makes room for it
            slot = self._slot(used, protected(self._entries, chunk.parent))
            if slot is False:  # only its own prefix left to evict, or an orphan: kept by the backing alone
                self._c["chain_refused"] += 1
                return False
            if slot is None:
                self._c["oversize_refused"] += 1
                return False
            buf = self._arena.slots[slot]
            try:
                t = buf[:tb].view(chunk.target_kv.dtype).view(chunk.target_kv.shape)
                d = buf[draft_at:used].view(chunk.draft_kv.dtype).view(chunk.draft_kv.shape) \
                    if chunk.draft_kv is not None else None
                ready = self._copy_in(slot, [(t, chunk.target_kv)] + ([(d, chunk.draft_kv)] if d is not None else []))
            except BaseException:
                self._arena.free.append(slot)  # a copy that failed keeps no slot
                raise
            if not chunk.fresh():  # read from a bridge's arena past its hold: the slot may hold another chunk now
                self._arena.free.append(slot)
                self._c["stale_refused"] += 1
                return False
            local = KVChunk(chunk.key, chunk.parent, chunk.fingerprint, list(chunk.token_ids), t, d)
            self._entries.insert(chunk.key, _Entry(local, slot, draft_at, used, ready),
                                 lambda k: self._entries[k].chunk.parent)
            self._bytes += tb + db
            self._c["puts"] += 1
        return True

    def _slot(self, used: int, keep: str | None = "") -> int | None | bool:
        """Under the lock: a free slot for `used` bytes, evicting least recently used entries; None if
        the chunk is larger than a slot or the budget holds no slot at all; False if it may evict no more
        (store.protected: only the incoming chunk's own prefix is left, or it is an orphan)."""
        if used > self._arena.stride:
            return None
        slot = self._arena.take()
        while slot is None and self._entries:
            if not may_evict(self._entries, keep):
                return False
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.chunk.nbytes()
            self._c["evictions"] += 1
            self._arena.free.append(old.slot)  # its fences stay: the next write waits for them
            slot = self._arena.take()
        return slot

    def _copy_in(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event | None:
        """Copy the chunk's halves into the slot: on a CUDA store, from its device asynchronously on the
        side stream (after the producer's work and the slot's last readers); otherwise in place."""
        fences = self._fences.get(slot, {})  # kept until this write is queued: a failed one leaves the slot fenced
        if not (self._cuda and all(src.device == self.device for _, src in pairs)):
            for ev in fences.values():  # a host-side write must not race a DMA still using the slot
                ev.synchronize()
            self._fences.pop(slot, None)
            for dst, src in pairs:
                dst.copy_(src)
            return None
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        for ev in fences.values():
            side.wait_event(ev)
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(side)  # its memory is not reused before this copy ran
            ready = torch.cuda.Event()
            ready.record(side)
        self._fences[slot] = {side.cuda_stream: ready}
        return ready

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        """The entry on this store's device (LayoutMismatch, counted, when it is not of `layout`), else
        the backing store's, promoted."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                why = layout.check(e.chunk) if layout is not None else None
                if why is None:
                    self._freshen(key)
                    self._c["hits"] += 1
                    return self._read([e])[0]
                self._c["layout_refused"] += 1
                self._c["misses"] += 1
        if e is not None:
            raise LayoutMismatch(f"chunk {key[:16]}...: {why}")
        chunk = self.backing.get(key, layout) if self.backing is not None else None
        with self._lock:
            self._c["hits_backing" if chunk is not None else "misses"] += 1
        if chunk is not None:
            self._keep(chunk)  # promote: the next hit on this prefix is served from here
        return chunk

    def get_many(self, keys: list[str], layout: ChunkLayout | None = None) -> list[KVChunk]:
        """The leading chunks of `keys` that are present and fit `layout`, on this store's device: the
        ones held here first (their copies queued back to back, no host sync), then the rest from the
        backing store in one call when it can batch. The run ends before an entry that does not fit."""
        with self._lock:
            run: list[_Entry] = []
            for k in keys:
                e = self._entries.get(k)
                if e is None:
                    break
                if layout is not None and layout.check(e.chunk) is not None:
                    self._c["layout_refused"] += 1
                    self._c["misses"] += 1
                    return self._touch_and_read(run)
                run.append(e)
            out = self._touch_and_read(run)
        rest = keys[len(run):]
        if not rest:
            return out
        if self.backing is None:
            with self._lock:
                self._c["misses"] += 1
            return out
        return out + self._from_backing(rest, layout)

    def _touch_and_read(self, run: list[_Entry]) -> list[KVChunk]:
        for e in run:
            self._freshen(e.chunk.key)
        self._c["hits"] += len(run)
        return self._read(run)

    def _read(self, run: list[_Entry]) -> list[KVChunk]:
        """Under the lock (no put can take these slots before the copies are fenced): one copy per
        entry into a fresh buffer on the device, queued on the reader's current stream."""
        if not run:
            return []
        if not self._cuda:
            return [self._view(e, self._arena.slots[e.slot][:e.used].clone()) for e in run]
        stream = torch.cuda.current_stream(self.device)
        out = []
        for e in run:
            if e.ready is not None:
                if e.ready.query():
                    e.ready = None
                else:  # its put is still copying: the reader's stream waits on the GPU, the host does not
                    stream.wait_event(e.ready)
                    self._c["waits"] += 1
            buf = torch.empty(e.used, dtype=torch.uint8, device=self.device)
            buf.copy_(self._arena.slots[e.slot][:e.used], non_blocking=True)
            out.append(self._view(e, buf))
        done = torch.cuda.Event()
        done.record(stream)
        for e in run:
            self._fences.setdefault(e.slot, {})[stream.cuda_stream] = done
        return out

    @staticmethod
    def _view(e: _Entry, buf: torch.Tensor) -> KVChunk:
        """A chunk whose halves are views of `buf`, a copy of the entry's slot bytes."""
        c = e.chunk
        t = buf[:_nbytes(c.target_kv)].view(c.target_kv.dtype).view(c.target_kv.shape)
        d = buf[e.draft_at:e.used].view(c.draft_kv.dtype).view(c.draft_kv.shape) if c.draft_kv is not None else None
        return KVChunk(c.key, c.parent, c.fingerprint, list(c.token_ids), t, d)

    def _from_backing(self, keys: list[str], layout: ChunkLayout | None) -> list[KVChunk]:
        many = getattr(self.backing, "get_many", None)
        got = list(itertools.takewhile(lambda c: c is not None, many(keys, layout) if many is not None
                                       else leading_gets(self.backing, keys, layout)))
        with self._lock:
            self._c["hits_backing"] += len(got)
            self._c["misses"] += len(got) < len(keys)
        for c in got:
            self._keep(c)
        return got

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._entries:
                return True
        return self.backing is not None and self.backing.contains(key)

    def lookup(self, keys: list[str]) -> int:
        """How many leading keys this tier holds, then how many more the backing store does (asked once)."""
        with self._lock:
            n = leading(keys, self._entries.__contains__)
        if self.backing is not None and n < len(keys):
            n += self.backing.lookup(keys[n:])
        return n

    def stats(self) -> dict:
        with self._lock:
            a = self._arena
            out = dict(self._c, entries=len(self._entries), bytes=self._bytes, byte_budget=self.byte_budget,
                       device=str(self.device), pinned=self._cuda, slots=len(a.slots) if a else 0,
                       slot_bytes=a.stride if a else 0, allocations=a.allocations if a else 0,
                       host_bytes=a.host_bytes if a else 0)
        if self.backing is not None:
            out["backing"] = self.backing.stats()
        return out

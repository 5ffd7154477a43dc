"""A bridge's memory store whose entries live in a shared-memory arena (arena.py): an SHM Get can send where an
entry lies instead of its bytes, and a same-host reader reads it in place."""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import NamedTuple

import numpy as np

from flashpd.kv_bridge.arena import HOLD_S, READER_MARGIN_S, Arena, ArenaRef
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.chunk import CorruptChunk, KVChunk, Lease
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.store import MemoryStore, verify_checked


class ArenaHandle(NamedTuple):
    """An entry's place: its arena, offset and length, how long from now its slot stays unreused, and its slot's
    generation word (where, and what it reads now)."""
    arena: ArenaRef
    offset: int
    length: int
    hold_s: float
    gen_offset: int
    gen: int


MAX_EXTRA_EVICTIONS = 16  # entries a put may evict beyond the budget's need, to find a free slot


class ArenaStore(MemoryStore):
    """MemoryStore (same LRU, admission and verification) whose entries live in an arena.

    The arena holds byte_budget plus `slack_bytes` (default: a quarter of the budget, at least 64 MiB): room for
    the slots of evicted entries still held for a reader (HOLD_S after their last read), for slots lent to Puts in
    flight (reserve, at most half the slack), and for rounding each slot up to whole pages. A put that finds no
    free slot evicts up to MAX_EXTRA_EVICTIONS more entries (free room can be in pieces where entries differ in
    size), then is refused (`arena_refused`). A copy into the arena (a put whose bytes were not received into a
    lent slot) happens under the store's lock: reads wait for it (a few milliseconds a chunk)."""

    def __init__(self, byte_budget: int, secret: ClusterSecret | None = None, slack_bytes: int | None = None,
                 hold_s: float = HOLD_S, populate: bool = True) -> None:
        super().__init__(byte_budget, secret)
        slack = max(byte_budget // 4, 64 << 20) if slack_bytes is None else slack_bytes
        self.arena = Arena(byte_budget + slack)
        if populate:  # its pages faulted in ahead of the puts, in the background (Arena.populate_async)
            self.arena.populate_async()
        self.hold_s = hold_s
        self._slot: dict[str, int] = {}  # key -> offset of its entry in the arena
        self._hold: dict[str, float] = {}  # key -> when its slot may be reused once evicted (time.monotonic)
        # lent buffers by a number of their own (never id(): a dead buffer's id is the next one's at once, and its
        # finalizer may run while another thread is between a drain and a new loan)
        self._reserved: dict[int, tuple[weakref.ref, int, int]] = {}  # number -> (buffer, offset, length)
        self._loans = itertools.count()
        # numbers of lent buffers that became garbage, appended by their finalizers (which take no lock and hold no
        # reference to the store: one may run anywhere, under any lock), freed by the next reserve, put or stats
        self._returned: list[int] = []
        self._lent = 0  # bytes of slots lent to Puts in flight
        self.max_lent_bytes = slack // 2  # past it a Put is received into memory of its own (and copied in)
        self._last = threading.local()  # what this thread's last read found: (key, offset, generation word)
        self._c.update(arena_refused=0, handles=0, filled_in_place=0)

    def close(self) -> None:
        """No reader can map the arena from now on (its descriptor is closed); mappings made stay valid."""
        self.arena.close()

    # -- writes: a receiver may fill a lent slot itself, so a put needs no copy of its own ---------------------
    def reserve(self, n: int) -> np.ndarray | None:
        """A writable buffer of n bytes in a free slot, for a receiver to fill (read a segment or frames into):
        put_bytes of a read-only view of it then takes the slot as it is, without a copy. A buffer not put (a chunk
        refused, a stream cut) gives its slot back once it is garbage. None when no slot is free now (the receiver
        uses memory of its own; the put copies)."""
        with self._lock:
            self._free_returned()
            if self._lent + n > self.max_lent_bytes:  # Puts in flight may not take the room evicted slots wait in
                return None
            off = self.arena.alloc(n)
            if off is None:
                return None
            buf = self.arena.buffer(off, n)
            loan = next(self._loans)
            self._reserved[loan] = (weakref.ref(buf), off, n)
            self._lent += n
        weakref.finalize(buf, self._returned.append, loan)
        return buf

    def _free_returned(self) -> None:
        """Under the lock: the slots of lent buffers that became garbage without being put."""
        while self._returned:
            found = self._reserved.pop(self._returned.pop(), None)
            if found is not None:
                self._lent -= found[2]
                self.arena.free(found[1], found[2])

    def _loan_of(self, data: bytes | memoryview) -> object | None:
        """Under the lock: the reservation whose slot `data` was assembled in (None: none). A few loans at a time:
        one per Put stream at most."""
        owner = data.obj if isinstance(data, memoryview) else None
        if owner is None:
            return None
        return next((k for k, (ref, _, n) in self._reserved.items() if ref() is owner and n == len(data)), None)

    def _placeable(self, data: bytes | memoryview) -> bool:
        """No free slot now and the least recently used entry's slot held by a recent read (evicting it, or the
        budget's next victims behind it, frees no room before their holds end): refused before the budget evicts
        anything. Else a Put refused for want of a slot had first evicted entries it could not use."""
        if self._loan_of(data) is not None:
            return True  # its slot is reserved: filled in place
        if self.arena.fits(len(data)) or (len(self._index) and not self._held_now(self._index.first())):
            return True
        self._c["arena_refused"] += 1
        return False

    def _place(self, key: str, data: bytes | memoryview, keep: str | None) -> memoryview | None:
        self._free_returned()
        loan = self._loan_of(data)
        if loan is not None:  # filled in place: no copy
            _, off, n = self._reserved.pop(loan)
            self._lent -= n
            self._slot[key] = off
            self._c["filled_in_place"] += 1
            return data
        off = self.arena.alloc(len(data))
        extra = 0
        while off is None and extra < MAX_EXTRA_EVICTIONS and not self._held_now(self._index.first()) \
                and self._evict_one(keep):  # (an entry read within its hold would free no room now: kept)
            extra += 1
            off = self.arena.alloc(len(data))
        if off is None:
            self._c["arena_refused"] += 1
            return None
        self._slot[key] = off
        return self.arena.write(off, data)

    def _held_now(self, key: str | None) -> bool:
        """Under the lock: whether the entry's slot would be held if it were evicted now."""
        return key is not None and self._hold.get(key, 0.0) > time.monotonic()

    def _dropped(self, key: str, data: bytes | memoryview) -> None:
        off = self._slot.pop(key, None)
        if off is not None:
            self.arena.free(off, len(data), self._hold.pop(key, 0.0))

    # -- reads: every read holds the entry's slot for hold_s, so it is not reused under whoever reads it ----------
    def _read(self, key: str) -> None:
        self._hold[key] = time.monotonic() + self.hold_s
        off = self._slot[key]
        self._last.found = (key, off, *self.arena.generation(off))

    def _found(self, key: str) -> tuple[int, int, int]:
        """The offset and generation word (where, what it read) that this thread's read of `key` found, under the
        lock of that read: a later lookup could find another entry put under the key since."""
        k, off, gen_offset, gen = self._last.found
        assert k == key
        return off, gen_offset, gen

    def get_handle(self, key: str) -> ArenaHandle | None:
        """Where the entry lies, its slot held for hold_s from now; None on a miss. Not verified here: the entry
        was when it was put, a live entry is never rewritten, only this process's mapping can write the arena, and
        the reader verifies the MAC over the very bytes it then copies (a second pass over them here put as much
        time again on every hit's critical path: docs/results.md). A reader that finds an entry corrupt asks for
        its bytes (get_bytes verifies them), which drops it."""
        data = self._take(key)
        if data is None:
            return None
        off, gen_offset, gen = self._found(key)
        with self._lock:
            self._c["handles"] += 1
        return ArenaHandle(self.arena.ref, off, len(data), self.hold_s, gen_offset, gen)

    def get_bytes(self, key: str) -> bytes | None:
        """A copy of the entry, verified: whoever asks for bytes (an inline or segment Get, a disk tier) may keep
        them longer than any hold."""
        view = self._take(key)
        if view is None:
            return None
        data = bytes(view)
        try:
            verify_checked(key, data, self._mac)
        except CorruptChunk:
            self._drop_corrupt(key, view)
            return None
        return data

    def get_shared(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        """As MemoryStore's, the tensors views of the entry in the arena, its own while its Lease holds (the hold
        less the reader's margin, and the slot's generation word as this read found it)."""
        t = time.monotonic()
        chunk = super().get_shared(key, layout)
        if chunk is not None:
            _, gen_offset, gen = self._found(key)
            chunk.lease = Lease(t + self.hold_s - READER_MARGIN_S, self.arena.word(gen_offset), gen)
        return chunk

    def stats(self) -> dict:
        with self._lock:
            self._free_returned()
        st = super().stats()
        st.update(arena_bytes=self.arena.size, arena_held_bytes=self.arena.held_bytes(),
                  arena_populated_bytes=self.arena.populated)
        return st

"""The chunk store interface and its in-memory tier.

Entries are kept as the chunk's serialized bytes (KVChunk.to_bytes): one immutable object holds
both halves (target K/V and drafter K/V), so they are stored, evicted and dropped together. Bytes
are verified (MAC under the store's cluster secret, header schema, lengths, the key they are
filed under) when they arrive and again on every read before anything is handed out.
"""
from __future__ import annotations

import enum
import threading
from typing import Callable, Protocol, runtime_checkable

from flashpd.kv_bridge.auth import ClusterSecret, MacKey, resolve
from flashpd.kv_bridge.chunk import CorruptChunk, KVChunk, LayoutMismatch, peek_parent, verify_bytes
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.lru import ChainLRU


class PutResult(enum.Enum):
    STORED = "stored"  # a new entry
    PRESENT = "present"  # the key was already held: an idempotent no-op
    REFUSED = "refused"  # not stored (larger than the whole budget, or the write failed)


@runtime_checkable
class ChunkStore(Protocol):
    """get(key, layout): None when absent (or corrupt: dropped); raises LayoutMismatch when the entry
    is valid but not of `layout` (left in place: another reader may use it)."""

    def put(self, chunk: KVChunk) -> bool: ...
    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None: ...
    def contains(self, key: str) -> bool: ...
    def lookup(self, keys: list[str]) -> int: ...
    def stats(self) -> dict: ...


@runtime_checkable
class ByteStore(ChunkStore, Protocol):
    """A ChunkStore that also moves serialized chunks as is: the gRPC server's path (no decode/encode)."""

    def put_bytes(self, key: str, data: bytes, verified: bool = False) -> PutResult: ...
    def get_bytes(self, key: str) -> bytes | None: ...


def put_all(store, chunks: list[KVChunk]) -> int:
    """Put a prompt's chunks, in order: through the store's put_many when it has one (a bridge: one streamed call,
    each chunk serialised as the stream reaches it while the bridge takes the one before; a call a chunk left the
    two waiting on each other, half a publish's time), else one put each. How many the store holds of them."""
    many = getattr(store, "put_many", None)
    if many is not None and len(chunks) > 1:
        return many(chunks)
    return sum(bool(store.put(c)) for c in chunks)


def put_through(keep: Callable[[KVChunk], bool], backing, chunks: list[KVChunk]) -> int:
    """A worker tier's put_many: each chunk kept here (`keep`), then all of them to the backing store in one call
    where it takes one (put_all); how many are held here or there (the larger of the two counts). A chunk that
    fails to be kept here (the exception is raised after) still leaves every chunk to the backing store, as put()
    does chunk by chunk."""
    kept, failed = 0, None
    for c in chunks:
        try:
            kept += keep(c)
        except Exception as e:  # noqa: BLE001  raised below, once the backing store has them
            failed = e
            break
    backed = put_all(backing, chunks) if backing is not None else 0
    if failed is not None:
        raise failed
    return max(kept, backed)


def freshen(index: ChainLRU, key: str, parent_of: Callable[[str], str]) -> None:
    """In a store's recency index (least recent first): key, then each held chunk before it in its prompt (parent_of
    a held key: its parent's key, "" for a prompt's first chunk), become the most recently used, the first chunk
    last, so most recent of all (ChainLRU.freshen; O(1) for a prompt put or read in order)."""
    index.freshen(key, parent_of)


def protected(index: ChainLRU, parent: str) -> str | None:
    """What a put whose chunk names `parent` may not evict to make room: its prompt's held chunks (evicting them
    would cut its own prefix), named by `parent` ("" for a prompt's first chunk: nothing). None for an orphan
    (parent named, not held): of no use here until its parent comes back, it may take free room but evict nothing.
    Call it right after freshen(index, parent), which made those chunks the MRU tail of the index."""
    if parent and parent not in index:
        return None
    return parent


def may_evict(index: ChainLRU, keep: str | None) -> bool:
    """Whether a put protecting `keep` (protected(), after freshen of that parent) may evict the least recently
    used entry of index now. The parent's held chain is the index's MRU tail, parent first, so the LRU entry is
    one of them exactly when it is the parent itself: O(1), where a set of the chain cost a walk per put."""
    return keep is not None and bool(index) and (not keep or index.first() != keep)


def leading(keys: list[str], contains) -> int:
    """How many LEADING keys `contains` accepts: a prefix hit stops at the first gap."""
    n = 0
    for k in keys:
        if not contains(k):
            break
        n += 1
    return n



def leading_gets(store, keys: list[str], layout: ChunkLayout | None) -> list[KVChunk]:
    """What get_many gives, from single gets: the leading present chunks that fit `layout` (a tier's backing
    without get_many)."""
    out = []
    for k in keys:
        try:
            chunk = store.get(k, layout)
        except LayoutMismatch:
            break
        if chunk is None:
            break
        out.append(chunk)
    return out

def verify_checked(key: str, data: bytes | memoryview, mac: MacKey) -> None:
    """MAC, header, lengths and key of serialized bytes, without materialising the tensors."""
    verify_bytes(data, mac, key=key)


def decode_checked(key: str, data: bytes | bytearray | memoryview, mac: MacKey, own: bool = False,
                   layout: ChunkLayout | None = None, share: bool = False) -> KVChunk:
    """KVChunk.from_bytes (own, layout, share: see there) of bytes filed under `key`."""
    return KVChunk.from_bytes(data, mac, own, layout, key, share=share)


class IndexedStore:
    """What the memory and disk stores share: an LRU-ordered index of whole entries under one lock,
    counters, verification of incoming bytes, and the first-put-wins admission rule.

    Recency follows prompts: a put or hit makes the entry, then each held chunk before it in its prompt (its
    header's parent, and so on), the most recently used. A prompt's leading chunks thus always stay more recent
    than the chunks after them, so eviction takes a prompt's tail first. Plain LRU evicted the leading chunk
    first (it is read first), and that left the rest held but useless: a hit needs every chunk before it. A put
    that could only fit by evicting its own prompt's chunks, or one whose prompt's previous chunk is not held here
    (of no use until it is) and that needs room, is refused (`chain_refused`).

    secret: the cluster secret whose MAC key entries must carry (default: this process's)."""

    def __init__(self, byte_budget: int, secret: ClusterSecret | None = None) -> None:
        if byte_budget <= 0:
            raise ValueError("byte_budget must be positive")
        self.byte_budget = byte_budget
        self.secret = resolve(secret)
        self._mac = self.secret.mac_key
        self._index: ChainLRU[object] = ChainLRU()
        self._bytes = 0
        self._lock = threading.Lock()
        self._c = dict(hits=0, misses=0, puts=0, duplicate_puts=0, evictions=0, corrupt_refused=0,
                       corrupt_dropped=0, oversize_refused=0, layout_refused=0, chain_refused=0)
        self._parent: dict[str, str] = {}  # key -> the key of the chunk before it in its prompt, where known

    def put(self, chunk: KVChunk) -> bool:
        return self.put_bytes(chunk.key, chunk.to_view(self._mac), verified=True) is not PutResult.REFUSED

    def put_bytes(self, key: str, data: bytes, verified: bool = False) -> PutResult:
        raise NotImplementedError

    def _verify_incoming(self, key: str, data: bytes | memoryview, verified: bool) -> None:
        """Raise CorruptChunk (counted) unless the bytes are a valid chunk filed under `key`."""
        if verified:
            return
        try:
            verify_checked(key, data, self._mac)
        except CorruptChunk:
            with self._lock:
                self._c["corrupt_refused"] += 1
            raise

    # -- recency along prompts (lock held) --------------------------------------------------------------
    def _freshen(self, key: str) -> None:
        freshen(self._index, key, lambda k: self._parent.get(k, ""))

    def _link(self, key: str, data: bytes | memoryview) -> str | None:
        """Record the parent an incoming entry's header names and freshen its prompt's held chunks; returns
        what its eviction must not take (protected()). None for an orphan (its parent is not held here): it may
        take free room but evict nothing, since it is of no use here until its parent comes back."""
        parent = peek_parent(data)
        if not parent:
            return ""
        self._parent[key] = parent
        self._freshen(parent)
        return protected(self._index, parent)

    def _may_evict(self, keep: str | None) -> bool:
        return may_evict(self._index, keep)

    def _admission(self, key: str, size: int) -> PutResult | None:
        """Under the lock: PRESENT for a key already held (first put wins), REFUSED if it can never
        fit, None to go ahead."""
        if key in self._index:
            self._freshen(key)
            self._c["duplicate_puts"] += 1
            return PutResult.PRESENT
        if size > self.byte_budget:
            self._c["oversize_refused"] += 1
            return PutResult.REFUSED
        return None

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def lookup(self, keys: list[str]) -> int:
        """How many LEADING keys are held (a prefix hit stops at the first gap)."""
        with self._lock:
            return leading(keys, self._index.__contains__)

    def _decode(self, key: str, data: bytes, layout: ChunkLayout | None, found: object,
                share: bool = False) -> KVChunk | None:
        """The entry's chunk; None (dropped, counted) when it no longer verifies; LayoutMismatch
        (counted, the entry kept) when it is valid but not of `layout`. found: what names the entry read, for
        _drop_corrupt (a store drops only the very entry that failed, never one put under the key since).
        share: see get_shared."""
        try:
            return decode_checked(key, data, self._mac, layout=layout, share=share)
        except LayoutMismatch:
            with self._lock:
                self._c["layout_refused"] += 1
            raise
        except CorruptChunk:
            self._drop_corrupt(key, found)
            return None

    def _drop_corrupt(self, key: str, found) -> None:
        raise NotImplementedError


class MemoryStore(IndexedStore):
    """LRU over whole entries by bytes; thread-safe; an entry larger than the budget is refused."""

    _index: ChainLRU[bytes]

    # -- reads ----------------------------------------------------------------------------------
    def get_shared(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        """As get, verified the same way, but the tensors are read-only views of the entry's immutable bytes, not
        copies: for a reader that only copies them out (a prefix restore into its caches), which must never write
        them (every sharing reader would see the write)."""
        data = self._take(key)
        return None if data is None else self._decode(key, data, layout, data, share=True)

    # -- writes ---------------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, verified: bool = False) -> PutResult:
        """Store serialized chunk bytes. Raises CorruptChunk (and counts it) unless they verify.

        The first complete put of a key wins; a later put of the same key is a no-op, so
        concurrent writers never leave a torn or replaced entry. Immutable input is kept as is (bytes, or a
        read-only view the caller hands over, as the server's freshly assembled buffers): a copy into fresh
        memory here cost the bridge's Put more than the transport."""
        if not (isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly)):
            data = bytes(data)
        self._verify_incoming(key, data, verified)
        with self._lock:
            early = self._admission(key, len(data))
            if early is not None:
                return early
            keep = self._link(key, data)
            if not self._placeable(data):  # before the budget's evictions: a refusal then evicts nothing
                self._parent.pop(key, None)
                return PutResult.REFUSED
            while self._bytes + len(data) > self.byte_budget:
                if not self._evict_one(keep):  # only its own prompt's chunks are left to evict, or an orphan
                    self._parent.pop(key, None)
                    self._c["chain_refused"] += 1
                    return PutResult.REFUSED
            data = self._place(key, data, keep)
            if data is None:
                self._parent.pop(key, None)
                return PutResult.REFUSED
            self._index.insert(key, data, lambda k: self._parent.get(k, ""))
            self._bytes += len(data)
            self._c["puts"] += 1
            return PutResult.STORED

    def _evict_one(self, keep: str | None) -> bool:
        """Under the lock: evict the least recently used entry that `keep` allows (False: none)."""
        if not self._may_evict(keep):
            return False
        victim, old = self._index.popitem(last=False)
        self._parent.pop(victim, None)
        self._bytes -= len(old)
        self._c["evictions"] += 1
        self._dropped(victim, old)
        return True

    def _placeable(self, data: bytes | memoryview) -> bool:
        """Under the lock, before any eviction: False where `_place` could not take the entry whatever the budget's
        evictions free (counted by the subclass). Here always True."""
        return True

    def _place(self, key: str, data: bytes | memoryview, keep: str | None) -> bytes | memoryview | None:
        """Under the lock, room made within the budget: what the entry will be (None: refused after all, counted by
        the subclass). Here the bytes themselves; an arena store puts them in a slot of its arena (evicting more,
        as `keep` allows, where no slot is free)."""
        return data

    def _dropped(self, key: str, data: bytes | memoryview) -> None:
        """Under the lock: an entry left the index (evicted, removed or dropped as corrupt)."""

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        data = self._take(key)
        return None if data is None else self._decode(key, data, layout, data)

    def get_bytes(self, key: str) -> bytes | None:
        data = self._take(key)
        if data is None:
            return None
        try:
            verify_checked(key, data, self._mac)
        except CorruptChunk:
            self._drop_corrupt(key, data)
            return None
        return data

    def _take(self, key: str) -> bytes | None:
        with self._lock:
            data = self._index.get(key)
            if data is None:
                self._c["misses"] += 1
                return None
            self._freshen(key)
            self._c["hits"] += 1
            self._read(key)
            return data

    def _read(self, key: str) -> None:
        """Under the lock: the entry is being handed to a reader (an arena store holds its slot for it)."""

    def _drop_corrupt(self, key: str, data: bytes) -> None:
        """Remove the entry if it is still the one that failed; the read becomes a miss."""
        with self._lock:
            if self._index.get(key) is data:
                del self._index[key]
                self._parent.pop(key, None)
                self._bytes -= len(data)
                self._dropped(key, data)
            self._c["corrupt_dropped"] += 1
            self._c["hits"] -= 1
            self._c["misses"] += 1

    def remove(self, key: str) -> bool:
        with self._lock:
            data = self._index.pop(key, None)
            if data is None:
                return False
            self._parent.pop(key, None)
            self._bytes -= len(data)
            self._dropped(key, data)
            return True

    def stats(self) -> dict:
        with self._lock:
            return {**self._c, "bytes": self._bytes, "entries": len(self._index), "byte_budget": self.byte_budget}

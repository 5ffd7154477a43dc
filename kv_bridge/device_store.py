"""A worker's hot tier: cache entries kept as tensors on the KV cache's own device.

Every other store serialises a chunk (bytes + keyed MAC) and a hit copies it back through the
host: on a GPU that path restores a long Qwen3-8B-shaped prefix many times slower than this one, and through
shared memory or gRPC slower than recomputing it (docs/results.md). Here a hit is a device-to-device copy into the paged
caches. Entries are whole (target and drafter halves together), evicted least-recently-used under a
byte budget; a `backing` store (memory, disk, a remote bridge) receives every put and serves what
this tier evicted, promoting it back.

No MAC in this tier: its tensors never leave the process and are never serialised, so there is
nothing in transit to corrupt or forge. What every hit still checks is the reader's layout
(geometry, dtype, token count, method fingerprint, drafter half) and the PrefixCache's token ids.
The backing tier verifies its own MACs before anything from it is promoted here.
"""
from __future__ import annotations

import threading

import torch

from flashpd.kv_bridge.chunk import KVChunk, LayoutMismatch
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.lru import ChainLRU
from flashpd.kv_bridge.store import freshen, leading, leading_gets, may_evict, protected, put_through


class DeviceStore:
    def __init__(self, byte_budget: int, device: str | torch.device, backing=None) -> None:
        if byte_budget <= 0:
            raise ValueError("byte_budget must be positive")
        self.byte_budget = byte_budget
        self.device = torch.device(device)
        self.backing = backing
        self._entries: ChainLRU[KVChunk] = ChainLRU()
        self._bytes = 0
        self._lock = threading.Lock()
        self._c = dict(puts=0, hits_device=0, hits_backing=0, misses=0, evictions=0, too_large=0, chain_refused=0,
                       stale_refused=0)

    def _freshen(self, key: str) -> None:
        """(lock held) The entry, then its prompt's held chunks before it, become the most recent: eviction
        takes a prompt's tail first (store.freshen)."""
        freshen(self._entries, key, lambda k: self._entries[k].parent)

    def put(self, chunk: KVChunk) -> bool:
        """Keep the chunk here (its tensors moved to this device; PrefixCache.publish hands over fresh
        tensors, never views of live cache blocks) and in the backing store."""
        stored = self._keep(chunk)
        backed = self.backing.put(chunk) if self.backing is not None else False
        return stored or backed

    def put_many(self, chunks: list[KVChunk]) -> int:
        """put() of a prompt's chunks, the backing store's part in one call (store.put_through)."""
        return put_through(self._keep, self.backing, chunks)

    def _keep(self, chunk: KVChunk) -> bool:
        return self._keep_copy(chunk)[0]

    def _promoted(self, chunk: KVChunk) -> KVChunk:
        """A backing store's chunk, kept here; returned as this tier's entry where it holds one (a restore then
        writes it device to device, not from the host a second time), else as it came."""
        local = self._keep_copy(chunk)[1]
        return local if local is not None else chunk

    def _keep_copy(self, chunk: KVChunk) -> tuple[bool, KVChunk | None]:
        """(kept as a new entry, this tier's copy of the chunk: its entry, or None when it is not kept here, being
        too large, read stale, or refused to keep its prompt's earlier chunks)."""
        size = chunk.nbytes()
        if size > self.byte_budget:
            with self._lock:
                self._c["too_large"] += 1
            return False, None
        copy = chunk.lease is not None  # views of a bridge's arena: to() on their own device would keep the views
        local = KVChunk(chunk.key, chunk.parent, chunk.fingerprint, list(chunk.token_ids),
                        chunk.target_kv.to(self.device, copy=copy),
                        chunk.draft_kv.to(self.device, copy=copy) if chunk.draft_kv is not None else None)
        if not chunk.fresh():  # read from a bridge's arena past its hold: the bytes may be another chunk's
            with self._lock:
                self._c["stale_refused"] += 1
            return False, None
        with self._lock:
            if chunk.key in self._entries:  # first writer wins: an entry never changes under a reader
                self._freshen(chunk.key)
                return False, self._entries[chunk.key]  # (the copy just made goes: no budget counts it)
            self._freshen(chunk.parent)  # its prompt's earlier chunks are not what makes room for it
            keep = protected(self._entries, chunk.parent)
            while self._bytes + size > self.byte_budget and self._entries:
                if not may_evict(self._entries, keep):  # only its own prefix left to evict, or an orphan
                    self._c["chain_refused"] += 1  # kept by the backing alone
                    return False, None  # nor is this copy handed out: no budget counts it
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes()
                self._c["evictions"] += 1
            self._entries.insert(chunk.key, local, lambda k: self._entries[k].parent)
            self._bytes += size
            self._c["puts"] += 1
        return True, local

    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        """The entry (LayoutMismatch when it is not of `layout`), else the backing store's, promoted."""
        with self._lock:
            chunk = self._entries.get(key)
            if chunk is not None:
                self._freshen(key)
                self._c["hits_device"] += 1
        if chunk is not None:
            why = layout.check(chunk) if layout is not None else None
            if why is not None:
                raise LayoutMismatch(f"chunk {key[:16]}...: {why}")
            return chunk
        chunk = self.backing.get(key, layout) if self.backing is not None else None
        with self._lock:
            self._c["hits_backing" if chunk is not None else "misses"] += 1
        if chunk is not None:
            chunk = self._promoted(chunk)  # the next hit on this prefix stays on the device
        return chunk

    def get_many(self, keys: list[str], layout: ChunkLayout | None = None) -> list[KVChunk | None]:
        """A run of keys: device hits first, then the rest from the backing store in one call when it can
        batch (a remote bridge fetches a run in one RPC). The run ends before an entry that does not fit
        `layout` (get() then says why)."""
        out: list[KVChunk | None] = []
        for i, k in enumerate(keys):
            with self._lock:
                chunk = self._entries.get(k)
            if chunk is not None and layout is not None and layout.check(chunk) is not None:
                return out
            if chunk is None:
                return out + self._from_backing(keys[i:], layout)
            with self._lock:
                self._freshen(k)
                self._c["hits_device"] += 1
            out.append(chunk)
        return out

    def _from_backing(self, keys: list[str], layout: ChunkLayout | None) -> list[KVChunk | None]:
        if self.backing is None:
            with self._lock:
                self._c["misses"] += 1
            return [None]
        many = getattr(self.backing, "get_many", None)
        got = list(many(keys, layout)) if many is not None else leading_gets(self.backing, keys, layout)
        with self._lock:
            self._c["hits_backing"] += sum(c is not None for c in got)
            self._c["misses"] += len(keys) - sum(c is not None for c in got)
        return [self._promoted(c) if c is not None else None for c in got]

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._entries:
                return True
        return self.backing is not None and self.backing.contains(key)

    def lookup(self, keys: list[str]) -> int:
        """How many leading keys either tier holds."""
        return leading(keys, self.contains)

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._c, entries=len(self._entries), bytes=self._bytes, byte_budget=self.byte_budget,
                       device=str(self.device))
        if self.backing is not None:
            out["backing"] = self.backing.stats()
        return out

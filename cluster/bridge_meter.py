"""A store wrapper that counts the bytes and seconds a worker moves through the KV bridge.

Wraps the RemoteStore a worker's PrefixCache uses: reads (get / get_many / iter_many) count as "import",
writes (put) as "export". The totals feed the workers' bridge bytes and GB/s metrics; errors
pass through unchanged (the decode side's GuardedPrefixCache decides what they mean).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from flashpd.kv_bridge.chunk import KVChunk, LayoutMismatch
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.store import put_all


class MeteredStore:
    def __init__(self, store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self.bytes = {"import": 0, "export": 0}
        self.seconds = {"import": 0.0, "export": 0.0}
        self.chunks = {"import": 0, "export": 0}

    def _add(self, direction: str, chunks: list[KVChunk], t0: float) -> None:
        self._add_spent(direction, chunks, time.perf_counter() - t0)

    def _add_spent(self, direction: str, chunks: list[KVChunk], dt: float) -> None:
        with self._lock:
            self.bytes[direction] += sum(c.nbytes() for c in chunks)
            self.seconds[direction] += dt
            self.chunks[direction] += len(chunks)

    def gbps(self) -> dict[str, float]:
        """Average rate of each direction over all its transfers so far (0 before any)."""
        with self._lock:
            return {d: (self.bytes[d] / self.seconds[d] / 1e9 if self.seconds[d] > 0 else 0.0) for d in self.bytes}

    def put(self, chunk: KVChunk) -> bool:
        t0 = time.perf_counter()
        ok = self.store.put(chunk)
        self._add("export", [chunk], t0)
        return ok

    def put_many(self, chunks: list[KVChunk]) -> int:
        t0 = time.perf_counter()
        n = put_all(self.store, chunks)
        self._add("export", chunks, t0)
        return n

    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        t0 = time.perf_counter()
        c = self.store.get(key, layout)
        self._add("import", [c] if c is not None else [], t0)
        return c

    def get_many(self, keys: list[str], layout: ChunkLayout | None = None) -> list[KVChunk]:
        t0 = time.perf_counter()
        if hasattr(self.store, "get_many"):
            got = self.store.get_many(keys, layout)
        else:  # the leading present chunks that fit, as get_many gives them
            got = []
            for k in keys:
                try:
                    c = self.store.get(k, layout)
                except LayoutMismatch:
                    break
                if c is None:
                    break
                got.append(c)
        self._add("import", got, t0)
        return got

    def iter_many(self, keys: list[str], layout: ChunkLayout | None = None) -> Iterator[KVChunk]:
        """get_many's chunks one by one where the store reads them so (iter_many), metered when the run ends: the
        time inside the store's reads only, not the consumer's between them."""
        inner = getattr(self.store, "iter_many", None)
        if inner is None:
            yield from self.get_many(keys, layout)
            return
        got: list[KVChunk] = []
        spent = 0.0
        with contextlib.closing(inner(keys, layout)) as it:
            try:
                while True:
                    t0 = time.perf_counter()
                    try:
                        c = next(it)
                    except StopIteration:
                        return
                    finally:
                        spent += time.perf_counter() - t0
                    got.append(c)
                    yield c
            finally:
                self._add_spent("import", got, spent)

    def contains(self, key: str) -> bool:
        return self.store.contains(key)

    def lookup(self, keys: list[str]) -> int:
        return self.store.lookup(keys)

    def stats(self) -> dict:
        return self.store.stats()

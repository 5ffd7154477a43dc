"""LMCache (0.5.3) as a storage backend of the KV bridge, behind the ChunkStore interface.

What of LMCache runs here, precisely: an `LMCacheEngine` built by `LMCacheEngineBuilder` with its
`StorageManager` and `LocalCPUBackend` (LMCache's own CPU buffer allocator, LRU eviction, first
put of a key wins), and a flashpd GPU connector (`PackedChunkConnector`, a
`GPUConnectorInterface`) that packs a chunk's target layers, drafter layers and a MAC-sealed
header row into ONE LMCache KV_2LTD memory object (kv_bridge/lmcache_layout.py). Writes go
through `LMCacheEngine.store` and lookups through `LMCacheEngine.lookup`, both in LMCache's
hash mode with flashpd's method-aware keys, so LMCache's own method-blind token hashing never
names an entry. Reads take the object from the engine's `StorageManager` and unpack it through
the connector: what `LMCacheEngine.retrieve` does inside, minus its token hashing (retrieve
accepts only token ids). LMCache's CUDA ops (`c_ops`, the vLLM paged connectors) are not used:
they need libtorch_cuda; the connector is plain torch, so the same code runs on CPU and GPU.

Guarantees kept: every read re-verifies the object's keyed BLAKE3 MAC (the store's cluster
secret), its header and its key (a corrupt or mismatched object is removed, counted and read as a
miss) and, for a reader that gives its ChunkLayout, that the chunk is one it can use (else
LayoutMismatch, the object kept); a method fingerprint is part of every key, so another method's
entry is a miss; an entry has both halves or does not exist.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import multiprocessing
import os
import threading
import uuid
import warnings
from typing import Iterator

import torch

from flashpd.kv_bridge.auth import ClusterSecret, MacKey, resolve
from flashpd.kv_bridge.chunk import CorruptChunk, KVChunk, LayoutMismatch
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.lmcache_layout import PackedLayout, pack, unpack


@contextlib.contextmanager
def _lmcache_quirks() -> Iterator[None]:
    """Where LMCache modules load and its engine starts. Each LMCache logger attaches an
    OpenTelemetry LoggingHandler when opentelemetry is installed (ray brings it), which recent
    opentelemetry-sdk releases deprecate with one warning per logger: silenced here only.
    Building its engine sets PROMETHEUS_MULTIPROC_DIR in the process's environment for good (its
    observability module), and every process started from there would inherit it: prometheus_client
    then keeps a process's counters in files named by its pid, which a later process given that pid
    counts on from. Put back as it was."""
    prom = os.environ.get(_PROM_DIR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`LoggingHandler` in `opentelemetry-sdk` is deprecated",
                                    category=DeprecationWarning)
            yield
    finally:
        if prom is None:
            os.environ.pop(_PROM_DIR, None)
        else:
            os.environ[_PROM_DIR] = prom


log = logging.getLogger(__name__)

_PROM_DIR = "PROMETHEUS_MULTIPROC_DIR"


# Set before LMCache is imported: it reads both at import / engine creation. LMCache otherwise
# sends anonymous usage telemetry over HTTP and logs every store and retrieve at INFO.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

with _lmcache_quirks():
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.memory_management import MemoryObj
    from lmcache.v1.metadata import LMCacheMetadata


class PackedChunkConnector(GPUConnectorInterface):
    """LMCache's side of flashpd's KV layout: chunk tensors in, one KV_2LTD object per chunk.

    Stores pass `chunks=[KVChunk, ...]` (exported from the paged caches by
    engine/kv_transfer.py); reads pass `out=[]`, `keys=[...]` and optionally `reader` (a ChunkLayout)
    and get, per object, a KVChunk or the CorruptChunk / LayoutMismatch that verification raised."""

    def __init__(self, layout: PackedLayout, mac: MacKey) -> None:
        self.layout = layout
        self._mac = mac

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layout.rows, num_tokens, self.layout.width])

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        chunks: list[KVChunk] = kwargs["chunks"]
        for obj, start, chunk in zip(memory_objs, starts, chunks, strict=True):
            pack(self.layout, chunk, obj.tensor, self._mac)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        out: list[KVChunk | CorruptChunk | LayoutMismatch] = kwargs["out"]
        for obj, key in zip(memory_objs, kwargs["keys"], strict=True):
            try:
                out.append(unpack(self.layout, obj.tensor, key, self._mac, kwargs.get("reader")))
            except (CorruptChunk, LayoutMismatch) as e:
                out.append(e)


def chunk_hash(key: str) -> int:
    """LMCache's 64-bit chunk hash for a flashpd key (the full key is checked in the header)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _undo_failed_build(instance_id: str, before: set[threading.Thread]) -> None:
    """After a failed engine build: LMCache 0.5.3's storage manager starts its event loop's thread (not a daemon)
    before it makes its backends, and a backend that fails (a CPU size the host cannot pin) leaves it running,
    unreachable: the process then never exits. The loops of threads the build started are stopped here, and the
    half-built engine is unregistered."""
    for t in set(threading.enumerate()) - before:
        args = getattr(t, "_args", ())
        loop = args[0] if args else None
        if isinstance(loop, asyncio.AbstractEventLoop):
            loop.call_soon_threadsafe(loop.stop)
            t.join(5)
    try:
        LMCacheEngineBuilder.destroy(instance_id)
    except Exception:  # noqa: BLE001  nothing registered, or half of it: the build's error is what the caller sees
        log.debug("destroying the failed LMCache build %s", instance_id, exc_info=True)


class LMCacheStore:
    """A ChunkStore whose bytes live in LMCache's local CPU backend. close() when done."""

    def __init__(self, layout: PackedLayout, cpu_bytes: int, name: str = "flashpd",
                 secret: ClusterSecret | None = None) -> None:
        if cpu_bytes <= 0:
            raise ValueError("cpu_bytes must be positive")
        self.layout = layout
        self.secret = resolve(secret)
        self.instance_id = f"flashpd-{uuid.uuid4().hex[:12]}"
        self.connector = PackedChunkConnector(layout, self.secret.mac_key)
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=layout.chunk_tokens, local_cpu=True, max_local_cpu_size=cpu_bytes / 2**30,
            local_disk=None, max_local_disk_size=0, remote_url=None)
        metadata = LMCacheMetadata(model_name=name, world_size=1, local_world_size=1, worker_id=0,
                                   local_worker_id=0, kv_dtype=layout.dtype, kv_shape=layout.kv_shape,
                                   chunk_size=layout.chunk_tokens)
        method = multiprocessing.get_start_method(allow_none=True)
        before = set(threading.enumerate())
        try:
            with _lmcache_quirks():
                self.engine: LMCacheEngine = LMCacheEngineBuilder.get_or_create(
                    self.instance_id, config, metadata, self.connector, None, None)
                self.engine.post_init()
        except BaseException:
            _undo_failed_build(self.instance_id, before)
            raise
        finally:  # LMCacheEngine forces the process-wide start method to "spawn": put it back
            multiprocessing.set_start_method(method, force=True)
        self._lock = threading.Lock()
        self._c = dict(hits=0, misses=0, puts=0, duplicate_puts=0, refused=0, layout_refused=0, corrupt_dropped=0,
                       read_layout_refused=0)

    def close(self) -> None:
        LMCacheEngineBuilder.destroy(self.instance_id)

    def __enter__(self) -> "LMCacheStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _key(self, key: str) -> CacheEngineKey:
        return self.engine.token_database._make_key_by_hash(chunk_hash(key))

    def _count(self, name: str) -> None:
        self._c[name] += 1

    # -- ChunkStore -----------------------------------------------------------------------------
    def put(self, chunk: KVChunk) -> bool:
        """Store both halves as one LMCache object; True when stored or already held."""
        t = self.layout.chunk_tokens
        with self._lock:
            if self.layout.fits(chunk) is not None:
                self._count("layout_refused")
                return False
            if self._held([chunk.key]):
                self._count("duplicate_puts")
                return True
            # hash mode wants a slot_mapping (it makes it a tensor); the connector reads the chunk itself
            self.engine.store(hashes=[chunk_hash(chunk.key)], offsets=[t], slot_mapping=list(range(t)), chunks=[chunk])
            ok = self._held([chunk.key]) == 1
            self._count("puts" if ok else "refused")  # not stored: LMCache could not allocate
            return ok

    def get(self, key: str, layout: ChunkLayout | None = None) -> KVChunk | None:
        """The chunk, verified; a missing, corrupt or mismatched object is a miss. LayoutMismatch when
        it is valid but not of `layout` (the object stays)."""
        with self._lock:
            ck = self._key(key)
            obj = self.engine.storage_manager.get(ck)
            if obj is None:
                self._count("misses")
                return None
            out: list[KVChunk | CorruptChunk | LayoutMismatch] = []
            try:
                self.connector.batched_to_gpu([obj], [0], [self.layout.chunk_tokens], out=out, keys=[key],
                                              reader=layout)
            finally:
                obj.ref_count_down()
            if isinstance(out[0], LayoutMismatch):
                self._count("read_layout_refused")
                raise out[0]
            if isinstance(out[0], CorruptChunk):
                self.engine.storage_manager.remove(ck)
                self._count("corrupt_dropped")
                self._count("misses")
                return None
            self._count("hits")
            return out[0]

    def contains(self, key: str) -> bool:
        return self.lookup([key]) == 1

    def lookup(self, keys: list[str]) -> int:
        """How many LEADING keys LMCache holds."""
        with self._lock:
            return self._held(keys)

    def _held(self, keys: list[str]) -> int:
        if not keys:
            return 0
        t = self.layout.chunk_tokens
        return self.engine.lookup(hashes=[chunk_hash(k) for k in keys], offsets=[t] * len(keys)) // t

    def stats(self) -> dict:
        backend = self.engine.storage_manager.storage_backends["LocalCPUBackend"]
        with self._lock:
            own = dict(self._c)
            n = len(backend.hot_cache)
        size = self.layout.rows * self.layout.header_capacity  # header row = one layer's K and V
        return {**own, "entries": n, "bytes": n * size, "object_bytes": size, "backend": "lmcache.LocalCPUBackend"}

    # -- tests and tools ------------------------------------------------------------------------
    def object_tensor(self, key: str) -> torch.Tensor | None:
        """The LMCache memory object's tensor of a key, in place (fault-injection tests)."""
        obj = self.engine.storage_manager.get(self._key(key))
        if obj is None:
            return None
        obj.ref_count_down()
        return obj.tensor

"""The same-host device path: a decode worker copies a request's target KV and drafter state straight out
of the prefill worker's paged caches, device to device, with no host bytes and no per-chunk Python.

The exporter (prefill worker) shares its two paged caches once: on a GPU through CUDA IPC handles, on a
CPU through shared memory (torch.multiprocessing's file-system strategy: the stand-in the CPU tests
run). Host tensors (a CPU cache, and the block epochs, owners and busy word on any device) travel as file
descriptors that the importer maps itself (`host_share`): never through the exporter's torch_shm_manager,
whose death with a killed exporter made the importer abort as it dropped the mapping. What travels per request is control only: a lease (blocks, the number of positions, each block's
epoch). The prefill worker holds the lease's blocks until the decode worker releases them or the
lease's deadline passes. The importer maps an exporter's caches once, then per request copies whole
blocks of both caches with one gather and one scatter each.

Trust: the exported handles are pickles, so their blob is sealed with the cluster's MAC key and only a
blob that verifies is unpickled, by an unpickler that admits torch's tensor-rebuild functions alone.

One GPU, two processes: a GPU time-slices between the processes' contexts, so a prefill running beside
the decode worker's steps takes about twice as long. The exporter shares one more host word, set while
it computes a prefill (`computing()`); an importer on the same device (`peer_busy`) lets its engine
hold its next step until the prefill is done, which gives the prefill the GPU as a colocated engine's
scheduler does. A flag older than a bound is ignored (a prefill worker that died mid-prefill).

Use after free: the exporter bumps a block's epoch (in a shared host tensor) before the block can be
reused. The importer checks the lease's epochs before the copy and again after it completed; any
change means the blocks were freed meanwhile, and the copy is discarded (a counted fallback: the
prompt is recomputed).

Another request's blocks: the exporter also shares which lease holds each block, and the importer copies only
blocks of the handoff's own lease (a header naming another lease's blocks would import another prompt's KV as
this one's; the dist path's exporter refuses such a send the same way). A release names the lease's blocks and
epochs too, and frees the lease only if they are exactly its own: a header carrying another request's lease id
would otherwise free that lease early (its request then recomputes its prompt).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import pickle
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from flashpd.kv_bridge import host_share
from flashpd.kv_bridge.auth import MacKey

_BLOB_MAGIC = b"FPHO2"  # 2: host tensors as host_share descriptors (1: torch pickles)
# what a sealed export blob may name: torch's CUDA tensor rebuild and the types it takes (host tensors travel as
# host_share descriptors of plain values: no CPU storage is unpickled, so none connects to another process's manager)
_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.storage", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
    ("torch", "device"),
}


def prompt_digest(tokens: list[int]) -> bytes:
    """What binds a lease to its prompt: a decode worker imports a lease only for the prompt it was computed for
    (the length alone let another prompt's lease of the same length be imported, and decode its continuation)."""
    h = hashlib.sha256(b"flashpd-handoff-prompt")
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.digest()


class HandoffError(RuntimeError):
    """A handoff that cannot be used (bad seal, other geometry, freed blocks): the prompt is recomputed."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D102
        if (module, name) in _ALLOWED or (module == "torch" and name.endswith("Storage")) or \
                (module == "torch" and name in ("float32", "bfloat16", "float16", "int64")):
            return super().find_class(module, name)
        raise HandoffError(f"export blob names {module}.{name}, which a cache export never contains")


def _share_strategy(t: torch.Tensor) -> None:
    """CPU tensors cross unrelated processes only by file name (fds need a multiprocessing pipe)."""
    if t.device.type == "cpu":
        import torch.multiprocessing as mp  # noqa: PLC0415
        mp.set_sharing_strategy("file_system")


@dataclass(frozen=True)
class Geometry:
    """What an importer checks before it copies: both caches' shapes (blocks aside) and dtype."""

    target: tuple[int, ...]  # [layers, 2, kv_block_size, kv_heads, head_dim]
    draft: tuple[int, ...] | None
    dtype: str
    fingerprint: str
    device_id: str = ""  # which physical device holds the caches (a GPU's UUID; a host's name for a CPU)

    @classmethod
    def of(cls, target: torch.Tensor, draft: torch.Tensor | None, fingerprint: str) -> "Geometry":
        strip = lambda t: tuple(t.shape[:2]) + tuple(t.shape[3:])  # noqa: E731  (blocks are per worker)
        return cls(strip(target), strip(draft) if draft is not None else None,
                   str(target.dtype).removeprefix("torch."), fingerprint, device_id(target.device))


def device_id(dev: torch.device) -> str:
    """A name of the physical device that two processes agree on (CUDA indices depend on each one's
    CUDA_VISIBLE_DEVICES; a GPU's UUID does not)."""
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_properties(dev).uuid}"
    return f"{dev.type}:{socket.gethostname()}"


@dataclass
class Lease:
    """One request's prompt KV held by the exporter for one importer."""

    lease_id: int
    blocks: list[int]
    epochs: list[int]
    num_tokens: int
    deadline: float
    release: object = None  # what frees the blocks (the exporter's callback)


@dataclass(frozen=True)
class Handoff:
    """What the decode side receives per request (inside its DecodeRequest): control data only."""

    exporter_id: str
    exporter_address: str
    blob: bytes  # the sealed export (the same for every lease of one exporter)
    lease_id: int
    blocks: tuple[int, ...]
    epochs: tuple[int, ...]
    num_tokens: int
    prompt_digest: bytes = b""  # prompt_digest() of the prompt the lease's KV was computed for


class CacheExporter:
    """The prefill side: shares its caches once, hands out leases, frees them on release or deadline."""

    def __init__(self, target: torch.Tensor, draft: torch.Tensor | None, fingerprint: str, mac: MacKey,
                 address: str = "", lease_s: float = 10.0) -> None:
        for t in (target, draft):
            if t is not None:
                _share_strategy(t)
                if t.device.type == "cpu" and not t.is_shared():
                    raise ValueError("a CPU cache must be allocated shared (share_memory_()) before it is exported")
        self.exporter_id = uuid.uuid4().hex
        self.address = address
        self.lease_s = lease_s
        self.geometry = Geometry.of(target, draft, fingerprint)
        self.epochs = torch.zeros(target.shape[2], dtype=torch.int64)  # host memory, shared by file name
        _share_strategy(self.epochs)
        self.epochs.share_memory_()
        # [0]: CLOCK_MONOTONIC (ns, one clock for every process of a host) when the running prefill began, 0 idle
        self.busy = torch.zeros(1, dtype=torch.int64)
        self.busy.share_memory_()
        # the lease id holding each block (0: none), shared: an importer copies only its own lease's blocks
        self.owners = torch.zeros(target.shape[2], dtype=torch.int64)
        self.owners.share_memory_()
        from multiprocessing.reduction import ForkingPickler  # noqa: PLC0415

        on_gpu = lambda t: t if t is not None and t.device.type != "cpu" else None  # noqa: E731
        payload = bytes(ForkingPickler.dumps((on_gpu(target), on_gpu(draft))))  # CUDA IPC handles, or Nones
        host = {k: tuple(host_share.describe(t)) for k, t in (("target", target), ("draft", draft),
                ("epochs", self.epochs), ("busy", self.busy), ("owners", self.owners))
                if t is not None and t.device.type == "cpu"}
        # the id is sealed with the caches: an importer maps a blob under the id it was made for, and no other
        head = pickle.dumps({**self.geometry.__dict__, "exporter_id": self.exporter_id, "host": host}, protocol=4)
        body = _BLOB_MAGIC + len(head).to_bytes(4, "little") + head + payload
        self.blob = body + mac.tag([body])
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self.stats = dict(leases=0, released=0, expired=0, unknown_releases=0, refused_releases=0)

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Mark a prefill in progress for importers on the same device (see the module doc)."""
        self.busy[0] = time.monotonic_ns()
        try:
            yield
        finally:
            self.busy[0] = 0

    def lease(self, blocks: list[int], num_tokens: int, release, digest: bytes = b"") -> Handoff:
        """Hold `blocks` for an importer until its release (naming them) or the deadline; `release()` frees them.
        digest: prompt_digest() of the prompt they hold, which the importer compares with its request's."""
        with self._lock:
            lid = self._new_id()
            epochs = self.epochs[blocks].tolist() if blocks else []
            if blocks:
                self.owners[blocks] = lid
            self._leases[lid] = Lease(lid, list(blocks), epochs, num_tokens, time.monotonic() + self.lease_s, release)
            self.stats["leases"] += 1
        return Handoff(self.exporter_id, self.address, self.blob, lid, tuple(blocks), tuple(epochs), num_tokens,
                       digest)

    def _new_id(self) -> int:
        """A live lease's id: random (63 bits, never 0: owners' "none"), not the next of a count. Lease ids count
        from 1 let a cluster member who knew none of them name another request's lease by guessing (its epochs start
        at 0): 20 guesses read a lease's blocks over the dist path. Under the lock."""
        while True:
            lid = secrets.randbits(63)
            if lid and lid not in self._leases:
                return lid

    def check_blocks(self, lease_id: int, blocks: list[int], epochs: list[int]) -> None:
        """Raise HandoffError unless lease `lease_id` is live (given, neither released nor past its deadline) and
        holds each of `blocks`, named once, at the epoch given with it: a request may read its own lease's KV, never
        another lease's (another request's prompt), nor make a gather larger than its lease. The epochs are the
        lease's own, so the epoch checks around a gather refuse blocks freed (and leased again) after this check.
        Checks only: no lease is touched."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise HandoffError(f"lease {lease_id} was freed before the send (released or expired), or never given")
            if lease.deadline <= time.monotonic():
                raise HandoffError(f"lease {lease_id} is past its deadline (its blocks are being freed)")
            own = dict(zip(lease.blocks, lease.epochs))
        if len(set(blocks)) != len(blocks):
            raise HandoffError(f"request names a block of lease {lease_id} more than once")
        stray = [b for b in blocks if b not in own]
        if stray:
            raise HandoffError(f"lease {lease_id} does not hold block(s) {stray[:8]}")
        if any(own[b] != e for b, e in zip(blocks, epochs)):
            raise HandoffError(f"request's epochs are not those of lease {lease_id}'s blocks")

    def release(self, lease_id: int, blocks: Sequence[int], epochs: Sequence[int]) -> bool:
        """The importer is done (or gave up): free the lease's blocks. False for an unknown or expired lease, and
        for a release naming other blocks or epochs than the lease's own (`admits_release`), which leaves it live."""
        with self._lock:
            if not self._admits(lease_id, blocks, epochs):
                return False
            self._free(self._leases.pop(lease_id))
            self.stats["released"] += 1
        return True

    def admits_release(self, lease_id: int, blocks: Sequence[int], epochs: Sequence[int]) -> bool:
        """Whether release(lease_id, blocks, epochs) would free a live lease now, counted as `release` counts a
        refusal: for a caller that queues its releases (PrefillHost) and so never makes a refused one."""
        with self._lock:
            return self._admits(lease_id, blocks, epochs)

    def _admits(self, lease_id: int, blocks: Sequence[int], epochs: Sequence[int]) -> bool:
        """Under the lock: the lease is live and holds exactly `blocks` at `epochs`, as its handoff named them. A
        handoff header names any lease id it likes: one carrying another request's id would free that lease early."""
        lease = self._leases.get(lease_id)
        if lease is None:
            self.stats["unknown_releases"] += 1
            return False
        if [int(b) for b in blocks] != lease.blocks or [int(e) for e in epochs] != lease.epochs:
            self.stats["refused_releases"] += 1
            return False
        return True

    def expire(self, now: float | None = None) -> int:
        """Free every lease past its deadline (an importer that died or never came); returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
            for lid in late:
                self._free(self._leases.pop(lid))
            self.stats["expired"] += len(late)
        return len(late)

    def _free(self, lease: Lease) -> None:
        if lease.blocks:  # bump first: an importer mid-copy sees the change and discards its copy
            self.epochs[lease.blocks] += 1
            self.owners[lease.blocks] = 0
        lease.release()

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._leases)

    def holds(self, lease_id: int) -> bool:
        """Whether the lease is live (given, not yet released or expired); thread-safe, touches no block."""
        with self._lock:
            return lease_id in self._leases


def _check_owned(h: Handoff, owners: torch.Tensor) -> None:
    """The blocks are h's own lease's, each named once (HandoffError otherwise): a header naming another lease's blocks
    would import another request's prompt KV as this one's. Checked after the epochs matched, so a block freed since
    (its owner cleared, its epoch bumped) reads as freed; one leased again since fails the epoch re-check after the
    copy."""
    if len(set(h.blocks)) != len(h.blocks):
        raise HandoffError(f"handoff names a block of lease {h.lease_id} more than once")
    stray = [b for b, o in zip(h.blocks, owners.tolist()) if o != h.lease_id]
    if stray:
        raise HandoffError(f"lease {h.lease_id} does not hold block(s) {stray[:8]}")


class CacheImporter:
    """The decode side: maps each exporter's caches once, copies a lease's blocks into its own caches."""

    def __init__(self, target: torch.Tensor, draft: torch.Tensor | None, fingerprint: str, mac: MacKey) -> None:
        self.target, self.draft = target, draft
        self.geometry = Geometry.of(target, draft, fingerprint)
        self.mac = mac
        host_share.header_bytes()  # found once, at start (it shares a probe: torch starts its manager), not in a request
        # exporter id -> (its target cache, draft cache, epochs, block owners; the MAC tag of the blob they were mapped
        # from)
        self._maps: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, bytes]] = {}
        self._peers: dict[str, torch.Tensor] = {}  # busy words of the exporters on this worker's own device
        # the exporter id mapped from each address: a restarted prefill worker comes back under a new id, and the
        # old id's caches (a dead process's whole KV cache) are dropped then, not kept mapped for good
        self._ids: dict[str, str] = {}
        self.stats = dict(imports=0, failures=0, positions=0, mapped_exporters=0)

    def _map(self, h: Handoff) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The exporter's caches and epochs, mapped on its first handoff. A handoff whose blob is not the one its
        exporter id was sealed into (another exporter's, with this id) is refused: else it would read this
        exporter's blocks as the other's, whose epochs may well coincide (a wrong KV, used silently)."""
        got = self._maps.get(h.exporter_id)
        if got is not None:
            if h.blob[-32:] != got[4]:
                raise HandoffError(f"export blob: not the one exporter {h.exporter_id[:12]} sealed")
            return got[:4]
        blob = h.blob
        if len(blob) < len(_BLOB_MAGIC) + 4 + 32 or not blob.startswith(_BLOB_MAGIC):
            raise HandoffError("export blob: not a flashpd cache export")
        body, tag = blob[:-32], blob[-32:]
        if not self.mac.verify([body], tag):
            raise HandoffError("export blob: MAC does not verify (not made with this cluster's secret)")
        n = int.from_bytes(body[len(_BLOB_MAGIC):len(_BLOB_MAGIC) + 4], "little")
        off = len(_BLOB_MAGIC) + 4
        head = _Unpickler(io.BytesIO(body[off:off + n])).load()
        if not isinstance(head, dict) or head.pop("exporter_id", None) != h.exporter_id:
            raise HandoffError("export blob: sealed for another exporter id")
        host = head.pop("host", None)
        if not isinstance(host, dict):
            raise HandoffError("export blob: no host tensors")
        geometry = Geometry(**head)
        if (geometry.target, geometry.draft, geometry.dtype) != \
                (self.geometry.target, self.geometry.draft, self.geometry.dtype):
            raise HandoffError(f"exporter's caches {geometry} do not fit this worker's {self.geometry}")
        if geometry.fingerprint != self.geometry.fingerprint:
            raise HandoffError("exporter runs another method (fingerprint differs)")
        src_t, src_d = _Unpickler(io.BytesIO(body[off + n:])).load()
        src_t, src_d, epochs, busy, owners = self._attach(host, src_t, src_d)
        strip = lambda t: None if t is None else tuple(t.shape[:2]) + tuple(t.shape[3:])  # noqa: E731
        if (strip(src_t), strip(src_d)) != (geometry.target, geometry.draft) or \
                epochs.shape != owners.shape or epochs.shape != (src_t.shape[2],) or busy.numel() < 1:
            raise HandoffError("export blob: its tensors do not have the shapes its geometry names")
        old = self._ids.get(h.exporter_address)
        if old is not None and old != h.exporter_id:
            self.forget(old)
        self._ids[h.exporter_address] = h.exporter_id
        self._maps[h.exporter_id] = (src_t, src_d, epochs, owners, tag)
        if geometry.device_id == self.geometry.device_id:
            self._peers[h.exporter_id] = busy
        self.stats["mapped_exporters"] = len(self._maps)
        return src_t, src_d, epochs, owners

    @staticmethod
    def _attach(host: dict, src_t, src_d) -> tuple:
        """The export's host tensors mapped from their files (host_share), the CUDA caches as unpickled."""
        if src_t is None and "target" not in host:
            raise HandoffError("export blob: no target cache")
        try:
            got = {k: host_share.attach(host_share.HostShare(*v)) for k, v in host.items()
                   if k in ("target", "draft", "epochs", "busy", "owners")}
        except (TypeError, ValueError) as e:
            raise HandoffError(f"export blob: {e}") from None
        if not {"epochs", "busy", "owners"} <= got.keys():
            raise HandoffError("export blob: no block epochs, owners or busy word")
        return (got.get("target", src_t), got.get("draft", src_d), got["epochs"], got["busy"], got["owners"])

    def forget(self, exporter_id: str) -> None:
        """Drop an exporter's mapping (it went away; a restarted one comes with a new id)."""
        self._maps.pop(exporter_id, None)
        self._peers.pop(exporter_id, None)
        for addr in [a for a, i in self._ids.items() if i == exporter_id]:
            del self._ids[addr]
        self.stats["mapped_exporters"] = len(self._maps)

    def peer_busy(self, stale_s: float) -> bool:
        """An exporter on this worker's device is computing a prefill that began less than stale_s ago."""
        if not self._peers:
            return False
        now = time.monotonic_ns()
        return any(0 < now - int(b[0]) < stale_s * 1e9 for b in list(self._peers.values()))

    def copy(self, h: Handoff, dst_blocks: list[int]) -> None:
        """Copy the lease's blocks into dst_blocks of this worker's caches (both halves). Raises
        HandoffError when the handoff cannot be used; then nothing copied may be read."""
        try:
            src_t, src_d, epochs, owners = self._map(h)
            nblk = len(h.blocks)
            if nblk != len(dst_blocks) or nblk != len(h.epochs):
                raise HandoffError(f"lease of {nblk} blocks for {len(dst_blocks)} destination blocks")
            if nblk == 0:
                return
            if max(h.blocks) >= src_t.shape[2] or min(h.blocks) < 0:
                raise HandoffError("lease names blocks outside the exporter's cache")
            want = torch.tensor(h.epochs, dtype=torch.int64)
            idx = torch.tensor(h.blocks, dtype=torch.int64)
            if not torch.equal(epochs[idx], want):
                raise HandoffError("lease's blocks were freed before the import (epoch changed)")
            _check_owned(h, owners[idx])
            didx = torch.tensor(dst_blocks, dtype=torch.int64, device=self.target.device)
            for src, dst in ((src_t, self.target), (src_d, self.draft)):
                if dst is None:
                    continue
                vals = src.index_select(2, idx.to(src.device))
                dst.index_copy_(2, didx, vals.to(dst.device, non_blocking=True))
            if self.target.device.type == "cuda":
                torch.cuda.current_stream(self.target.device).synchronize()  # copies done before the re-check
            if not torch.equal(epochs[idx], want):
                raise HandoffError("lease's blocks were freed during the import (epoch changed)")
            self.stats["imports"] += 1
            self.stats["positions"] += h.num_tokens
        except HandoffError:
            self.stats["failures"] += 1
            raise
        except Exception as e:  # noqa: BLE001  a handle that does not open, a dead exporter's segment, ...
            self.stats["failures"] += 1
            self.forget(h.exporter_id)  # mapped again (or refused) by its next handoff, not kept broken
            raise HandoffError(f"{type(e).__name__}: {e}") from None

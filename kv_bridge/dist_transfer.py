"""The cross-host KV path (kv_transport "dist"): a lease's blocks travel over a torch.distributed process
group between the prefill worker that holds them and the decode worker that imports them: NCCL between
GPUs (on one host or two), gloo between CPUs (what the tests run). The code is the same for both
backends apart from the backend's name.

One `PairGroup` per (exporter, importer): a 2-rank process group (exporter rank 0, importer rank 1) made
without torch.distributed's default group, so one process holds one per peer. Its rendezvous store is an
in-memory store of the exporter's, one per pair; the importer's rank reaches it only through sealed PairStore
calls (`RemotePairStore`). There is no store port: an open TCPStore let anyone who reached it list a pair's keys,
join the pair in the importer's place (receiving another request's KV) or between the two (feeding the importer
forged KV), and fill the exporter's memory. Every wait is bounded.

Control travels over gRPC (PrefillWorker.OpenPair / SendLease, cluster/dist_control.py), every request
and the OpenPair reply MAC-sealed with the cluster key. Per request:

  1 importer -> SendLease(pair, lease id, blocks, epochs, tag), sealed; the tag grows per pair (no replay)
  2 exporter: the lease is live and holds every named block at the named epoch (the seal proves only a
    cluster member: a request reads its own lease's KV, never another's) -> the epochs unchanged (the
    blocks still hold the prompt) -> one gather of the blocks into one contiguous buffer per half ->
    epochs checked again (a lease freed during the gather is refused, as CacheImporter refuses one freed
    during its copy) -> reply OK, and queue the send on the pair's sender thread. From the gather on, the
    blocks are no longer read: the lease can go.
  3 importer, on OK only: receives both halves (bounded) into staging buffers (`fetch`, on a thread of
    the decode scheduler's: the engine keeps stepping meanwhile), then, at the request's admission on the
    engine thread, scatters them into its own blocks (`apply`); the lease is released as on the device
    path (Release RPC). A refusal raises HandoffError with the pair intact; any failure after OK (timeout,
    dead peer) drops the pair on both sides (the next request opens a new one) and raises HandoffError:
    the scheduler counts it and recomputes the prompt.

Ordering: one transfer at a time per pair (NCCL ignores tags): the importer holds a per-exporter lock from
SendLease to the end of the receive, the sender sends in the order it said OK, and the importer posts its
receives only after OK, so a refused request never leaves a receive waiting.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from flashpd.kv_bridge.auth import MacKey
from flashpd.kv_bridge.handoff import CacheExporter, Geometry, Handoff, HandoffError

log = logging.getLogger(__name__)
_DOMAIN = "flashpd dist-transfer v1"
MAX_PAIRS = 64  # pairs one exporter holds (one per importer; an importer's new pair replaces its old one)
SEEN_NONCES = 1 << 16  # OpenPair nonces an exporter remembers (each importer draws a fresh one per pair)


class PairLost(HandoffError):
    """The pair cannot go on (the exporter dropped it, or is gone): the importer opens a new one next time."""


def seal(mac: MacKey, *fields) -> bytes:
    """The MAC of one control message's fields (JSON-encoded: unambiguous), under this module's domain."""
    return mac.tag([_DOMAIN.encode(), json.dumps([f.hex() if isinstance(f, bytes) else f for f in fields]).encode()])


def _verify(mac: MacKey, tag: bytes, *fields) -> bool:
    import hmac  # noqa: PLC0415

    return hmac.compare_digest(seal(mac, *fields), bytes(tag))


NONCE_BYTES = 16
MAX_IMPORTER_ID = 128
STORE_OPS = ("set", "get", "add", "check", "wait", "compare_set", "delete_key", "num_keys")
STORE_MAX_KEYS = 64  # keys one pair's store holds (gloo writes 2, NCCL a few)
STORE_MAX_VALUE = 1 << 16  # bytes a value (a gloo address blob is about 170, an NCCL unique id 128)
STORE_MAX_KEY = 512
STORE_WAITERS = 4  # PairStore gets and waits a pair has blocked at once (a formation makes 1-2)
STORE_WAITERS_ALL = 32  # and all pairs together: each holds a server thread of the worker's while it waits


def _td(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def _wait(work, timeout_s: float, what: str) -> None:
    """Wait for one send/recv, at most timeout_s. gloo: Work.wait(timeout) raises when it passes. NCCL:
    wait() only orders the current stream after the work, so completion is polled (bounded) too."""
    deadline = time.monotonic() + timeout_s
    work.wait(_td(timeout_s))
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not complete after {timeout_s:g} s")
        time.sleep(0.0002)


class PairGroup:
    """A 2-rank process group (rank 0 exporter, rank 1 importer) on `store`, outside the default group.
    Constructing it waits (at most timeout_s) until both ranks joined."""

    def __init__(self, store: dist.Store, rank: int, device: torch.device, host: str, timeout_s: float) -> None:
        self.rank, self.device, self.timeout_s = rank, device, timeout_s
        # held for the group's life: a Python store (RemotePairStore) that only the C++ group references is
        # collected, and a group that uses its store after construction (NCCL's lazy init at the first send or
        # receive, gloo's with TORCH_GLOO_LAZY_INIT) then fails every call to it
        self.store = store
        if device.type == "cuda":
            self.backend = "nccl"
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            # NCCL's watchdog acts on this timeout (by default it ends the process): well beyond the bounded
            # waits below, so a stuck transfer is dropped by this code (abort) first. Connects lazily.
            opts._timeout = _td(max(60.0, 3 * timeout_s))
            self.pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
        else:
            self.backend = "gloo"
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _td(timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # the advertised interface
            self.pg = dist.ProcessGroupGloo(store, rank, 2, opts)

    def send(self, bufs: Sequence[torch.Tensor], tag: int, timeout_s: float) -> None:
        works = [self.pg.send([b], 1 - self.rank, 2 * tag + i) for i, b in enumerate(bufs)]
        for w in works:
            _wait(w, timeout_s, "send")

    def recv(self, bufs: Sequence[torch.Tensor], tag: int, timeout_s: float) -> None:
        works = [self.pg.recv([b], 1 - self.rank, 2 * tag + i) for i, b in enumerate(bufs)]
        for w in works:
            _wait(w, timeout_s, "recv")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pg.abort()


def gather_blocks(target: torch.Tensor, draft: torch.Tensor | None, blocks: Sequence[int]) -> list[torch.Tensor]:
    """The blocks of both halves, one contiguous buffer per half (one index_select each)."""
    idx = torch.tensor(list(blocks), dtype=torch.int64, device=target.device)
    return [c.index_select(2, idx) for c in (target, draft) if c is not None]


def send_blocks(pair: PairGroup, target: torch.Tensor, draft: torch.Tensor | None, blocks: Sequence[int],
                tag: int, timeout_s: float | None = None) -> None:
    """Gather `blocks` of both caches and send them to the pair's other rank."""
    pair.send(gather_blocks(target, draft, blocks), tag, timeout_s or pair.timeout_s)


def recv_staged(pair: PairGroup, target: torch.Tensor, draft: torch.Tensor | None, n: int, tag: int,
                timeout_s: float | None = None) -> list[torch.Tensor]:
    """Receive n blocks of both halves into fresh contiguous buffers, one per half (no cache block is written:
    what an asynchronous fetch does off the engine thread)."""
    caches = [c for c in (target, draft) if c is not None]
    bufs = [torch.empty(c.shape[:2] + (n,) + c.shape[3:], dtype=c.dtype, device=c.device) for c in caches]
    pair.recv(bufs, tag, timeout_s or pair.timeout_s)
    return bufs


def scatter_blocks(target: torch.Tensor, draft: torch.Tensor | None, bufs: Sequence[torch.Tensor],
                   dst_blocks: Sequence[int]) -> None:
    """Write received buffers (recv_staged's) into dst_blocks of this side's caches: one index_copy_ per half."""
    caches = [c for c in (target, draft) if c is not None]
    if len(bufs) != len(caches) or any(b.shape[2] != len(dst_blocks) for b in bufs):
        raise HandoffError(f"staged {[tuple(b.shape) for b in bufs]} do not fit {len(dst_blocks)} blocks of "
                           f"{len(caches)} caches")
    idx = torch.tensor(list(dst_blocks), dtype=torch.int64, device=target.device)
    for c, b in zip(caches, bufs):
        c.index_copy_(2, idx, b)


def recv_blocks(pair: PairGroup, target: torch.Tensor, draft: torch.Tensor | None, dst_blocks: Sequence[int],
                tag: int, timeout_s: float | None = None) -> None:
    """Receive len(dst_blocks) blocks of both halves and scatter them into dst_blocks of this side's caches."""
    bufs = recv_staged(pair, target, draft, len(dst_blocks), tag, timeout_s)
    scatter_blocks(target, draft, bufs, dst_blocks)


def _geometry_json(g: Geometry) -> str:
    return json.dumps([list(g.target), list(g.draft) if g.draft is not None else None, g.dtype, g.fingerprint])


@dataclass
class _ExportPair:
    importer_id: str
    ready: threading.Event
    sender: ThreadPoolExecutor
    store: dist.Store
    group: PairGroup | None = None
    last_tag: int = 0
    broken: bool = False
    sending: bool = False  # a send queued or in flight (one at a time: the importer waits for each)
    idle: threading.Event = field(default_factory=threading.Event)  # set while no send is queued or in flight
    store_lock: threading.Lock = field(default_factory=threading.Lock)  # a key count's check and its write as one
    waiters: threading.BoundedSemaphore = field(default_factory=lambda: threading.BoundedSemaphore(STORE_WAITERS))
    last_used: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.idle.set()


def apply_store_op(store: dist.Store, op: str, key: str, value: bytes, expected: bytes, amount: int,
                   keys: Sequence[str], timeout_s: float) -> tuple[bytes, int, bool]:
    """One PairStore call on the exporter's store of a pair: (value, number, ok) as the op returns them. Sizes are
    bounded by the caller; a get or wait waits at most timeout_s (DistStoreError past it)."""
    if op == "set":
        store.set(key, value)
        return b"", 0, True
    if op == "get":
        store.wait([key], _td(timeout_s))
        return bytes(store.get(key)), 0, True
    if op == "add":
        return b"", int(store.add(key, int(amount))), True
    if op == "check":
        return b"", 0, bool(store.check(list(keys)))
    if op == "wait":
        store.wait(list(keys), _td(timeout_s))
        return b"", 0, True
    if op == "compare_set":
        return bytes(store.compare_set(key, expected, value)), 0, True
    if op == "delete_key":
        return b"", 0, bool(store.delete_key(key))
    return b"", int(store.num_keys()), True  # num_keys


class RemotePairStore(dist.Store):
    """The importer's view of a pair's store: each op is a sealed PairStore call to the exporter that holds it."""

    def __init__(self, control: "Control", mac: MacKey, address: str, exporter_id: str, nonce: bytes,
                 timeout_s: float) -> None:
        super().__init__()
        self._control, self._mac, self._address = control, mac, address
        self._exporter_id, self._nonce, self._timeout_s = exporter_id, nonce, timeout_s

    def _call(self, op: str, key: str = "", value: bytes = b"", expected: bytes = b"", amount: int = 0,
              keys: Sequence[str] = (), timeout_s: float | None = None) -> tuple[bytes, int, bool]:
        wait_s = self._timeout_s if timeout_s is None else min(timeout_s, self._timeout_s)
        fields = store_fields(self._exporter_id, self._nonce, op, key, value, expected, amount, keys, wait_s)
        out, number, ok, tag = self._control.pair_store(self._address, *fields, seal(self._mac, "store", *fields))
        if not _verify(self._mac, tag, "stored", self._nonce, op, key, out, number, ok):
            raise PairLost("PairStore reply: seal does not verify (not made with this cluster's secret)")
        return out, number, ok

    def set(self, key, value) -> None:  # noqa: D102
        self._call("set", key, bytes(value))

    def get(self, key) -> bytes:  # noqa: D102
        return self._call("get", key)[0]

    def add(self, key, amount) -> int:  # noqa: D102
        return self._call("add", key, amount=int(amount))[1]

    def check(self, keys) -> bool:  # noqa: D102
        return self._call("check", keys=list(keys))[2]

    def wait(self, keys, timeout=None) -> None:  # noqa: D102
        self._call("wait", keys=list(keys), timeout_s=None if timeout is None else timeout.total_seconds())

    def compare_set(self, key, expected, desired) -> bytes:  # noqa: D102
        return self._call("compare_set", key, bytes(desired), bytes(expected))[0]

    def delete_key(self, key) -> bool:  # noqa: D102
        return self._call("delete_key", key)[2]

    def num_keys(self) -> int:  # noqa: D102
        return self._call("num_keys")[1]

    getNumKeys = num_keys  # noqa: N815  (the names torch's C++ trampoline looks up)
    deleteKey = delete_key  # noqa: N815

    def set_timeout(self, timeout) -> None:  # noqa: D102
        self._timeout_s = min(self._timeout_s, timeout.total_seconds())


def store_fields(exporter_id: str, nonce: bytes, op: str, key: str, value: bytes, expected: bytes, amount: int,
                 keys: Sequence[str], timeout_s: float) -> tuple:
    """A PairStore request's fields, in the order its seal covers them."""
    return (exporter_id, bytes(nonce), op, key, bytes(value), bytes(expected), int(amount), list(keys),
            float(timeout_s))


class DistExporter:
    """The prefill side: a CacheExporter's leases, sent over per-importer PairGroups (see the module doc).
    `host`: the address importers reach this worker at (its store and gloo bind there alone)."""

    def __init__(self, exporter: CacheExporter, target: torch.Tensor, draft: torch.Tensor | None, mac: MacKey,
                 host: str = "127.0.0.1", timeout_s: float = 10.0) -> None:
        self.exporter, self.target, self.draft, self.mac = exporter, target, draft, mac
        self.host, self.timeout_s = host, timeout_s
        self.geometry = _geometry_json(exporter.geometry)
        self._pairs: dict[bytes, _ExportPair] = {}
        self._waiters = threading.BoundedSemaphore(STORE_WAITERS_ALL)  # blocking PairStore calls, all pairs
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # nonces opened before: a replayed OpenPair's
        self._lock = threading.Lock()
        self.stats = dict(pairs_opened=0, pairs_dropped=0, pairs_evicted=0, sends=0, refused=0, send_failures=0,
                          replays_refused=0, store_calls=0, store_refused=0)

    @property
    def exporter_id(self) -> str:
        return self.exporter.exporter_id

    def open_pair(self, exporter_id: str, importer_id: str, nonce: bytes, tag: bytes) -> tuple[str, str, bytes]:
        """Start the pair's rank 0 (it joins on a thread of its own); returns (store address, geometry, seal).

        A nonce opens one pair only: a replayed OpenPair (its seal verifies) is refused, so it can neither tear
        down the importer's live pair nor start a second one. With MAX_PAIRS open, the least recently used pair
        goes (an importer that died never reopens under its id; one that lives reopens on its next send)."""
        if not _verify(self.mac, tag, "open", exporter_id, importer_id, nonce):
            raise PermissionError("OpenPair: seal does not verify (not made with this cluster's secret)")
        if exporter_id != self.exporter_id:
            raise HandoffError("OpenPair: another exporter (it restarted)")
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"OpenPair: a nonce is {NONCE_BYTES} bytes, not {len(nonce)}")
        if not 0 < len(importer_id) <= MAX_IMPORTER_ID:
            raise ValueError(f"OpenPair: an importer id is 1 to {MAX_IMPORTER_ID} characters")
        with self._lock:
            if nonce in self._seen:
                self.stats["replays_refused"] += 1
                raise HandoffError("OpenPair: this nonce opened a pair before (a replay)")
            self._seen[nonce] = None
            while len(self._seen) > SEEN_NONCES:
                self._seen.popitem(last=False)
            address = ""  # the pair's store is reached by PairStore calls (no store port)
            for k, p in list(self._pairs.items()):  # an importer's new pair replaces its old one
                if p.importer_id == importer_id:
                    self._drop(k)
            while len(self._pairs) >= MAX_PAIRS:
                oldest = min(self._pairs, key=lambda k: self._pairs[k].last_used)
                log.warning("dist: %d pairs open; the least recently used (importer %s) goes", MAX_PAIRS,
                            self._pairs[oldest].importer_id)
                self._drop(oldest)
                self.stats["pairs_evicted"] += 1
            store = dist.HashStore()
            store.set_timeout(_td(self.timeout_s))
            pair = _ExportPair(importer_id, threading.Event(), ThreadPoolExecutor(1, thread_name_prefix="dist-send"),
                               store)
            self._pairs[nonce] = pair
        threading.Thread(target=self._join, args=(nonce, pair, store), name="dist-pair", daemon=True).start()
        return address, self.geometry, seal(self.mac, "opened", nonce, address, self.geometry)

    def pair_store(self, exporter_id: str, nonce: bytes, op: str, key: str, value: bytes, expected: bytes,
                   amount: int, keys: Sequence[str], timeout_s: float, seal_: bytes) -> tuple[bytes, int, bool, bytes]:
        """The importer's rank at its pair's store (RemotePairStore): one op, sealed both ways. Only a live pair's
        store, within STORE_MAX_KEYS keys of STORE_MAX_VALUE bytes, a wait within this exporter's timeout."""
        fields = store_fields(exporter_id, nonce, op, key, value, expected, amount, keys, timeout_s)
        if not _verify(self.mac, seal_, "store", *fields):
            raise PermissionError("PairStore: seal does not verify (not made with this cluster's secret)")
        if exporter_id != self.exporter_id:
            raise HandoffError("PairStore: another exporter (it restarted)")
        try:
            if op not in STORE_OPS:
                raise ValueError(f"PairStore: op {op!r} is not one of {list(STORE_OPS)}")
            if len(key) > STORE_MAX_KEY or len(keys) > STORE_MAX_KEYS or any(len(k) > STORE_MAX_KEY for k in keys):
                raise ValueError("PairStore: key too long, or too many keys")
            if len(value) > STORE_MAX_VALUE or len(expected) > STORE_MAX_VALUE:
                raise ValueError(f"PairStore: a value is at most {STORE_MAX_VALUE} bytes")
            with self._lock:
                pair = self._pairs.get(bytes(nonce))
            if pair is None or pair.broken:
                raise PairLost("PairStore: no such pair (closed or never formed)")
            wait_s = float(timeout_s)
            # under 1 ms is 0 ms to a store, and 0 is "no timeout" (NaN fails the test too)
            if not 0.001 <= wait_s <= self.timeout_s:
                wait_s = self.timeout_s
            if op in ("get", "wait"):  # blocking: a few a pair at once (each holds a server thread while it waits)
                if not pair.waiters.acquire(blocking=False):
                    raise ValueError(f"PairStore: {STORE_WAITERS} gets or waits of this pair are waiting already")
                if not self._waiters.acquire(blocking=False):
                    pair.waiters.release()
                    raise ValueError(f"PairStore: {STORE_WAITERS_ALL} gets or waits are waiting already")
                try:
                    out, number, ok = apply_store_op(pair.store, op, key, b"", b"", 0, keys, wait_s)
                finally:
                    self._waiters.release()
                    pair.waiters.release()
            else:
                with pair.store_lock:
                    if op in ("set", "add", "compare_set") and not pair.store.check([key]) and \
                            pair.store.num_keys() >= STORE_MAX_KEYS:
                        raise ValueError(f"PairStore: the pair's store holds {STORE_MAX_KEYS} keys already")
                    out, number, ok = apply_store_op(pair.store, op, key, bytes(value), bytes(expected), amount,
                                                     keys, wait_s)
        except (ValueError, PairLost):
            self.stats["store_refused"] += 1
            raise
        except dist.DistStoreError as e:  # a get or wait that timed out: the importer's formation fails, bounded
            self.stats["store_refused"] += 1
            raise PairLost(f"PairStore: {op}: {e}") from None
        self.stats["store_calls"] += 1
        return out, number, ok, seal(self.mac, "stored", bytes(nonce), op, key, out, number, ok)

    def _join(self, nonce: bytes, pair: _ExportPair, store) -> None:
        try:
            group = PairGroup(store, 0, self.target.device, self.host, self.timeout_s)
            with self._lock:  # one decision with _drop's: a pair dropped while its group formed closes it here
                pair.group, dropped = group, pair.broken
                self.stats["pairs_opened"] += 1
            if dropped:  # _drop's close found no group yet: it would leak (a process group, its store client)
                group.close()
        except Exception as e:  # noqa: BLE001  nobody (or a stranger) joined in time: the pair goes
            log.warning("dist pair with importer %s not formed: %s", pair.importer_id, e)
            with self._lock:
                if self._pairs.get(nonce) is pair:
                    self._drop(nonce)
        finally:
            pair.ready.set()

    def _drop(self, nonce: bytes) -> None:  # under self._lock
        pair = self._pairs.pop(nonce, None)
        if pair is None:
            return
        pair.broken = True
        self.stats["pairs_dropped"] += 1

        def close() -> None:
            if pair.group is not None:
                pair.group.close()

        pair.sender.submit(close)  # after the sends already queued (they fail against a closed peer)
        pair.sender.shutdown(wait=False)

    def send_lease(self, exporter_id: str, nonce: bytes, lease_id: int, blocks: Sequence[int],
                   epochs: Sequence[int], tag: int, seal_: bytes) -> None:
        """Check and gather a lease's blocks, then queue their send (returning means: they will be sent).
        Raises (nothing queued, nothing allocated, no lease touched) when the request is not sealed, names blocks
        its lease does not hold (another request's KV) or a lease that is gone, the pair is unknown, or the
        blocks are freed. The seal proves only that a cluster member sent it: the lease check is what keeps one
        request from reading another's prompt."""
        blocks, epochs = [int(b) for b in blocks], [int(e) for e in epochs]
        if not _verify(self.mac, seal_, "send", exporter_id, nonce, int(lease_id), blocks, epochs, int(tag)):
            raise PermissionError("SendLease: seal does not verify (not made with this cluster's secret)")
        if exporter_id != self.exporter_id:
            raise HandoffError("SendLease: another exporter (it restarted)")
        try:
            self._check_lease(int(lease_id), blocks, epochs)
        except HandoffError:
            self.stats["refused"] += 1
            raise
        with self._lock:
            pair = self._pairs.get(nonce)
        if pair is None or not pair.ready.wait(self.timeout_s) or pair.group is None or pair.broken:
            raise PairLost("SendLease: no such pair (closed or never formed)")
        marked = False
        # the importer's receive can end before this side's sender marks its send done: wait for that (bounded)
        pair.idle.wait(self.timeout_s)
        try:
            with self._lock:
                if pair.broken:  # dropped while this waited for its last send (which failed)
                    raise PairLost("SendLease: the pair was closed")
                if tag <= pair.last_tag:
                    raise HandoffError("SendLease: tag not above the pair's last (a replay)")
                if pair.sending:  # the importer waits for each receive: a second is not its own (or a flood)
                    raise HandoffError("SendLease: the pair's last send has not ended")
                pair.last_tag = tag
                pair.last_used = time.monotonic()
                pair.sending = marked = True
                pair.idle.clear()
            idx = torch.tensor(blocks, dtype=torch.int64)
            want = torch.tensor(epochs, dtype=torch.int64)
            if not torch.equal(self.exporter.epochs[idx], want):
                raise HandoffError("lease's blocks were freed before the send (epoch changed)")
            bufs = gather_blocks(self.target, self.draft, blocks)
            if self.target.device.type == "cuda":
                torch.cuda.current_stream(self.target.device).synchronize()  # gathered before the re-check
            self._after_gather(lease_id)
            if not torch.equal(self.exporter.epochs[idx], want):
                raise HandoffError("lease's blocks were freed during the gather (epoch changed)")
        except BaseException as e:
            if marked:  # refused (or failed) after it was marked: nothing was queued
                pair.sending = False
                pair.idle.set()
            if isinstance(e, HandoffError):
                self.stats["refused"] += 1
            raise
        try:
            pair.sender.submit(self._send, nonce, pair, bufs, tag)
        except RuntimeError:  # the pair was dropped meanwhile (its sender shut down)
            pair.sending = False
            pair.idle.set()
            raise PairLost("SendLease: the pair was closed") from None

    def _check_lease(self, lease_id: int, blocks: list[int], epochs: list[int]) -> None:
        """Before the pair, the tag or a gather: the blocks lie in the cache and are the live lease's own, at its
        epochs (CacheExporter.check_blocks). HandoffError otherwise: the pair goes on, every lease untouched."""
        if not blocks or len(blocks) != len(epochs) or max(blocks) >= self.target.shape[2] or min(blocks) < 0:
            raise HandoffError("SendLease: lease names blocks outside the exporter's cache")
        try:
            self.exporter.check_blocks(lease_id, blocks, epochs)
        except HandoffError as e:
            raise HandoffError(f"SendLease: {e}") from None

    def _after_gather(self, lease_id: int) -> None:
        """Between the gather and the epochs' re-check: nothing here; a subclass may act (the fault tests free
        the lease there)."""

    def _before_send(self, tag: int) -> None:
        """On the sender thread before a send: nothing here; a subclass may act (the fault tests stall or die)."""

    def _send(self, nonce: bytes, pair: _ExportPair, bufs: list[torch.Tensor], tag: int) -> None:
        try:
            self._before_send(tag)
            pair.group.send(bufs, tag, self.timeout_s)
            self.stats["sends"] += 1
        except Exception as e:  # noqa: BLE001  the importer died or gave up: the pair goes (it reopens one)
            self.stats["send_failures"] += 1
            log.warning("dist send of tag %d to importer %s failed: %s", tag, pair.importer_id, e)
            with self._lock:
                if self._pairs.get(nonce) is pair:
                    self._drop(nonce)
        finally:
            pair.sending = False
            pair.idle.set()

    def close(self) -> None:
        with self._lock:
            for k in list(self._pairs):
                self._drop(k)


class Control(Protocol):
    """The importer's control channel to exporters (gRPC: cluster/dist_control.DistControlClient). Raises
    HandoffError for a refusal that leaves the pair usable, PairLost for anything else (a failed call)."""

    def open_pair(self, address: str, exporter_id: str, importer_id: str, nonce: bytes,
                  seal_: bytes) -> tuple[str, str, bytes]: ...

    def send_lease(self, address: str, exporter_id: str, nonce: bytes, lease_id: int, blocks: Sequence[int],
                   epochs: Sequence[int], tag: int, seal_: bytes) -> None: ...

    def pair_store(self, address: str, exporter_id: str, nonce: bytes, op: str, key: str, value: bytes,
                   expected: bytes, amount: int, keys: Sequence[str], timeout_s: float,
                   seal_: bytes) -> tuple[bytes, int, bool, bytes]: ...


@dataclass
class _ImportPair:
    nonce: bytes
    group: PairGroup
    address: str  # the exporter's, where the pair was opened: its control calls go there and nowhere else
    tag: int = 0


@dataclass
class Staged:
    """A lease's blocks received (DistImporter.fetch), not yet written into any cache block: one contiguous
    buffer per half, applied at admission (DistImporter.apply) into the blocks the request is given then."""

    handoff: Handoff
    bufs: list[torch.Tensor]


class DistImporter:
    """The decode side: one PairGroup per exporter (opened on first use). `fetch` (any thread) receives a lease's
    blocks into staging buffers; `apply` (the engine thread, at admission) writes them into the request's blocks;
    `copy` is both at once, as CacheImporter's.

    Ordering: a pair's tags grow and its receives must be posted in the order its SendLeases were answered, so
    one exporter's fetches run one at a time, each holding that exporter's lock from opening the pair (if need
    be) through SendLease to the end of the receive. Fetches from different exporters run in parallel."""

    def __init__(self, target: torch.Tensor, draft: torch.Tensor | None, fingerprint: str, mac: MacKey,
                 control: Control, host: str = "127.0.0.1", timeout_s: float = 10.0) -> None:
        self.target, self.draft, self.mac, self.control = target, draft, mac, control
        self.host, self.timeout_s = host, timeout_s
        self.geometry = _geometry_json(Geometry.of(target, draft, fingerprint))
        self.importer_id = uuid.uuid4().hex
        self._pairs: dict[str, _ImportPair] = {}
        # exporter address -> the id of the exporter last paired there: a restarted prefill worker comes back at its
        # old address under a new id, and the dead one's pair (its store's socket, the group's threads) is dropped
        self._ids: dict[str, str] = {}
        self._lock = threading.Lock()  # the dicts below and the stats (fetches run on several threads)
        # per exporter: one transfer at a time (see above); an entry [lock, fetches holding or waiting for it] lives
        # only while a fetch of that exporter does, so ids of exporters long gone (restarts) leave nothing behind
        self._exporter_locks: dict[str, list] = {}
        self._closed = False  # close() ran: no fetch starts a transfer, and a pair left in use goes at its turn's end
        self.stats = dict(imports=0, failures=0, positions=0, pairs_opened=0, pairs_dropped=0)

    def peer_busy(self, stale_s: float) -> bool:  # noqa: ARG002  (the device path's same-GPU hold: not here)
        return False

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    @contextlib.contextmanager
    def _exporter_turn(self, exporter_id: str) -> Iterator[None]:
        """Hold exporter_id's transfer lock: that exporter's fetches run one at a time."""
        with self._lock:
            entry = self._exporter_locks.setdefault(exporter_id, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._lock:
                entry[1] -= 1
                last = entry[1] == 0
                if last:
                    del self._exporter_locks[exporter_id]
            if last and self._closed:  # close() left this exporter's pair to its last fetch
                self.forget(exporter_id)

    def _pair(self, h: Handoff) -> _ImportPair:
        """The pair with h's exporter, opened (OpenPair, its store, the group's formation: all bounded) when there is
        none. Called with that exporter's lock held."""
        with self._lock:
            got = self._pairs.get(h.exporter_id)
        if got is not None:
            return got
        nonce = secrets.token_bytes(16)
        address, geometry, tag = self.control.open_pair(
            h.exporter_address, h.exporter_id, self.importer_id, nonce,
            seal(self.mac, "open", h.exporter_id, self.importer_id, nonce))
        if not _verify(self.mac, tag, "opened", nonce, address, geometry):
            raise HandoffError("OpenPair reply: seal does not verify (not made with this cluster's secret)")
        if geometry != self.geometry:
            raise HandoffError(f"exporter's caches {geometry} do not fit this worker's {self.geometry}")
        store = RemotePairStore(self.control, self.mac, h.exporter_address, h.exporter_id, nonce, self.timeout_s)
        try:
            group = PairGroup(store, 1, self.target.device, self.host, self.timeout_s)
        except Exception as e:  # noqa: BLE001
            raise HandoffError(f"pair with exporter not formed: {type(e).__name__}: {e}") from None
        pair = _ImportPair(nonce, group, h.exporter_address)
        with self._lock:
            self._pairs[h.exporter_id] = pair
            self.stats["pairs_opened"] += 1
            old, self._ids[h.exporter_address] = self._ids.get(h.exporter_address), h.exporter_id
        if old is not None and old != h.exporter_id:  # (after the new one answered, sealed: the old one is gone)
            self.forget(old)
        return pair

    def forget(self, exporter_id: str, pair: _ImportPair | None = None) -> None:
        """Drop the pair with an exporter (it failed, or went away); with `pair`, only if it is still that one."""
        with self._lock:
            got = self._pairs.get(exporter_id)
            if got is None or (pair is not None and got is not pair):
                return
            del self._pairs[exporter_id]
            self.stats["pairs_dropped"] += 1
            for addr in [a for a, i in self._ids.items() if i == exporter_id]:
                del self._ids[addr]
        got.group.close()

    def fetch(self, h: Handoff) -> Staged:
        """Ask h's exporter for the lease's blocks and receive both halves into staging buffers (blocking, bounded
        by timeout_s per wait; safe on any thread: no cache block is written). Raises HandoffError when that
        cannot be done (PairLost and any failure after the exporter's OK also drop the pair)."""
        try:
            nblk = len(h.blocks)
            if nblk != len(h.epochs):
                raise HandoffError(f"lease of {nblk} blocks with {len(h.epochs)} epochs")
            if nblk == 0:
                return Staged(h, [])
            on_device = torch.cuda.device(self.target.device) if self.target.device.type == "cuda" else \
                contextlib.nullcontext()  # a pool thread's current device is not the engine's
            with self._exporter_turn(h.exporter_id), on_device:
                return Staged(h, self._transfer(h))
        except HandoffError:
            self._count("failures")
            raise
        except Exception as e:  # noqa: BLE001  opening the pair failed in an unforeseen way (no pair was kept)
            self._count("failures")
            raise HandoffError(f"{type(e).__name__}: {e}") from None

    def _refuse_if_closed(self) -> None:
        """A fetch still running when the importer was closed (an import thread its scheduler let go) starts no
        transfer: a pair it formed then would never be closed."""
        if self._closed:
            raise HandoffError("the importer is closed (its worker is stopping)")

    def _transfer(self, h: Handoff) -> list[torch.Tensor]:
        """SendLease, then the receive of its blocks; under h's exporter lock (the pair's order)."""
        self._refuse_if_closed()
        pair = self._pair(h)
        self._refuse_if_closed()  # closed while the pair formed: it goes at this turn's end, unused
        if h.exporter_address != pair.address:  # the pair's nonce and tags go to its own exporter only
            raise HandoffError(f"handoff names exporter {h.exporter_id[:12]} at {h.exporter_address!r}, its pair's "
                               f"is at {pair.address!r}")
        pair.tag += 1
        blocks, epochs = [int(b) for b in h.blocks], [int(e) for e in h.epochs]
        try:
            self.control.send_lease(h.exporter_address, h.exporter_id, pair.nonce, h.lease_id, blocks, epochs,
                                    pair.tag, seal(self.mac, "send", h.exporter_id, pair.nonce, int(h.lease_id),
                                                   blocks, epochs, pair.tag))
        except PairLost:
            self.forget(h.exporter_id, pair)
            raise
        except HandoffError:  # a refusal: nothing was sent, the pair stays in step
            raise
        except Exception as e:  # noqa: BLE001  a control call that failed in an unforeseen way: the pair goes
            self.forget(h.exporter_id, pair)
            raise HandoffError(f"{type(e).__name__}: {e}") from None
        try:  # the exporter said it sends: receive, or the pair is out of step and goes
            return recv_staged(pair.group, self.target, self.draft, len(blocks), pair.tag, self.timeout_s)
        except Exception as e:  # noqa: BLE001
            self.forget(h.exporter_id, pair)
            raise HandoffError(f"receive failed: {type(e).__name__}: {str(e)[:200]}") from None

    def apply(self, staged: Staged, dst_blocks: list[int]) -> None:
        """Write a fetch's buffers into dst_blocks of this worker's caches (both halves): the engine thread's part,
        at admission, into blocks the request owns."""
        h = staged.handoff
        if len(h.blocks) != len(dst_blocks):
            self._count("failures")
            raise HandoffError(f"lease of {len(h.blocks)} blocks for {len(dst_blocks)} destination blocks")
        if dst_blocks:
            scatter_blocks(self.target, self.draft, staged.bufs, dst_blocks)
            if self.target.device.type == "cuda":  # allocated on the fetch thread's stream: freed after this copy
                for b in staged.bufs:
                    b.record_stream(torch.cuda.current_stream(self.target.device))
        with self._lock:
            self.stats["imports"] += 1
            self.stats["positions"] += h.num_tokens

    def copy(self, h: Handoff, dst_blocks: list[int]) -> None:
        """Receive the lease's blocks into dst_blocks of this worker's caches (both halves): fetch, then apply.
        Raises HandoffError when that cannot be done; then nothing received may be read."""
        if len(h.blocks) != len(dst_blocks):
            self._count("failures")
            raise HandoffError(f"lease of {len(h.blocks)} blocks for {len(dst_blocks)} destination blocks")
        self.apply(self.fetch(h), dst_blocks)

    def close(self) -> None:
        """Drop every pair; fetches fail from now on. A worker closes its importer before the import threads its
        scheduler let go have ended, so a pair a fetch is using (its exporter's turn is held) is not aborted under
        that fetch: it goes when the turn ends (_exporter_turn), and a fetch starts no transfer after this."""
        with self._lock:
            self._closed = True
            idle = [k for k in self._pairs if k not in self._exporter_locks]
        for k in idle:
            self.forget(k)

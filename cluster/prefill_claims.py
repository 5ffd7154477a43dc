"""Prefill claims: how the router frees a prefill's lease whose answer it never got.

On the device and dist paths a prefill answers with a lease on the prompt's blocks (kv_bridge/handoff.py), which
the decode worker releases after its import, or the router when the request ends first. The router can only name a
lease it read in the answer. A client that cancels (or whose deadline passes) while the answer is on the wire
cancels the router's Prefill call after the worker's last check that the call is alive, so the worker hands the
lease to nobody and the router never learns its id: the prompt's blocks stayed held until `handoff_lease_s` (found
by a review's cancellation fuzzing: 3-12 blocks at a time in most bursts).

So the router names each Prefill call with a random claim (gRPC metadata CLAIM_HEADER, under the workers' token), and
after a Prefill that ended without an answer it sends Release(claim=...). The worker's ClaimBook maps each claim
to the lease its call made; a Release naming the claim frees that lease (a lease the decode worker released already
is unknown by then: no harm). A Release that comes before the lease exists (the call still running) leaves a
tombstone, and the lease is freed as it is made. Entries and tombstones go after `keep_s` (twice the lease
duration: a lease is gone by then) or past `max_entries`, oldest first.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import NamedTuple

CLAIM_HEADER = "x-flashpd-prefill-claim"
MAX_ENTRIES = 1 << 16


class Claimed(NamedTuple):
    """What a Release needs of a lease (kv_bridge/handoff.Handoff's fields, without its blob)."""

    exporter_id: str
    lease_id: int
    blocks: tuple[int, ...]
    epochs: tuple[int, ...]


def claim_from(metadata) -> int | None:
    """The call's claim (a positive 64-bit integer in decimal), None when it carries none; ValueError for a value
    that is not one (only the cluster's router calls a prefill worker: a bad claim is a bug, said)."""
    values = [v for k, v in metadata or () if k == CLAIM_HEADER]
    if not values:
        return None
    raw = values[0].decode("ascii", "replace") if isinstance(values[0], bytes) else values[0]
    if len(values) > 1 or not raw.isdigit() or not 0 < int(raw) < 1 << 64:
        raise ValueError(f"{CLAIM_HEADER}: one positive 64-bit integer, got {values!r}"[:200])
    return int(raw)


class ClaimBook:
    """claim -> the lease its Prefill made (or a tombstone: released before it was made). Thread-safe."""

    def __init__(self, keep_s: float, max_entries: int = MAX_ENTRIES) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, tuple[float, Claimed | None]] = OrderedDict()  # None: a tombstone
        self._by_lease: dict[int, int] = {}  # lease id -> its claim: a lease released by id drops its entry
        self.stats = {"released_by_claim": 0, "released_on_arrival": 0, "tombstones": 0}

    def _drop(self, claim: int) -> tuple[float, Claimed | None] | None:
        found = self._entries.pop(claim, None)
        if found is not None and found[1] is not None:
            self._by_lease.pop(found[1].lease_id, None)
        return found

    def _prune(self, now: float) -> None:
        while self._entries:
            claim, (t, _) = next(iter(self._entries.items()))
            if now - t < self.keep_s and len(self._entries) <= self.max_entries:
                break
            self._drop(claim)

    def forget(self, lease_id: int) -> None:
        """The lease was released by its id (the decode worker's import done): its claim has nothing left to free.
        Without this every answered Prefill's entry stayed keep_s (blocks and epochs: hundreds of MB at a long
        lease and long prompts, a review measured)."""
        with self._lock:
            claim = self._by_lease.pop(lease_id, None)
            if claim is not None:
                self._entries.pop(claim, None)

    def register(self, claim: int, lease: Claimed) -> bool:
        """Record the lease a claim's Prefill made; False when the claim was released already (its Release came
        first): the caller frees the lease now and answers without it."""
        now = time.monotonic()
        with self._lock:
            self._prune(now)
            found = self._drop(claim)
            if found is not None and found[1] is None:
                self.stats["released_on_arrival"] += 1
                return False
            self._entries[claim] = (now, lease)
            self._by_lease[lease.lease_id] = claim
            return True

    def take(self, claim: int) -> Claimed | None:
        """The lease to free for a Release naming `claim` (None: not made yet, and a tombstone now stands for it; or
        released by claim already)."""
        now = time.monotonic()
        with self._lock:
            self._prune(now)
            found = self._entries.get(claim)
            if found is None:
                self._entries[claim] = (now, None)
                self.stats["tombstones"] += 1
                return None
            if found[1] is None:  # a second Release of a claim never made: the tombstone stays where it is
                return None
            self._drop(claim)
            self.stats["released_by_claim"] += 1
            return found[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

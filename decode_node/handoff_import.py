"""The decode side of a prefill worker's KV hand-off: copy a request's prompt KV out of the prefill worker's
caches (the same-host device path, kv_bridge/handoff.py) or receive it over a pair (the dist path,
kv_bridge/dist_transfer.py: fetched off the engine thread, applied at admission), then have the lease
released at its exporter.

A handoff that cannot be used (a seal that does not verify, other geometry, blocks freed before or
during the copy, a dead exporter's handle) raises HandoffError: the scheduler counts it by reason and
recomputes the prompt, so the output never depends on which path the KV took. `release` is given by
the serving layer (an asynchronous RPC to the prefill worker); it must never block or raise.
"""
from __future__ import annotations

import re
import threading
from collections import Counter
from typing import TYPE_CHECKING, Callable

from flashpd.kv_bridge.handoff import CacheImporter, Handoff

if TYPE_CHECKING:
    from flashpd.kv_bridge.dist_transfer import Staged

MAX_REASONS = 32  # distinct fallback reasons counted apart; a new one past them counts as "other"
_NUMBER = re.compile(r"\d+")


class HandoffImport:
    """A CacheImporter, the lease release, and the fallbacks counted by reason."""

    def __init__(self, importer: CacheImporter, release: Callable[[Handoff], None]) -> None:
        self.importer = importer
        self.release = release
        self.fallbacks: Counter[str] = Counter()
        self._count_lock = threading.Lock()  # the engine thread and the import threads count at once

    def copy(self, h: Handoff, dst_blocks: list[int]) -> None:
        self.importer.copy(h, dst_blocks)

    @property
    def can_fetch(self) -> bool:
        """The importer splits an import into a fetch off the engine thread and an apply at admission (the dist
        path's DistImporter); the device path's local copy has no such split and runs at admission."""
        return hasattr(self.importer, "fetch") and hasattr(self.importer, "apply")

    def fetch(self, h: Handoff) -> Staged:
        """Receive the lease's blocks into staging buffers (blocking; any thread). Raises HandoffError."""
        return self.importer.fetch(h)

    def apply(self, staged: Staged, dst_blocks: list[int]) -> None:
        """Write a fetch's buffers into dst_blocks (the engine thread, at admission). Raises HandoffError."""
        self.importer.apply(staged, dst_blocks)

    def fallback(self, reason: str) -> None:
        """Count one fallback by reason. The keys are bounded: a message's numbers (lease ids, lengths, block
        counts) read as N, and past MAX_REASONS keys a new reason counts as "other" (keyed by the raw message,
        a worker gained one key per refused lease id for as long as it ran)."""
        key = _NUMBER.sub("N", reason)
        with self._count_lock:
            if key not in self.fallbacks and len(self.fallbacks) >= MAX_REASONS:
                key = "other"
            self.fallbacks[key] += 1

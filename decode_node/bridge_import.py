"""The decode side's import from the KV bridge, with a counted, logged fallback to local recompute.

A prompt's prefix comes from the bridge when it is there (published by a prefill worker). When
the import itself fails (bridge gone, timed out, a chunk that does not decode) the request is not
lost: its blocks are reset to empty and the prompt is recomputed locally, which gives the same
tokens and acceptance lengths as an import would. Each such fallback is logged and counted
(`import_failures`, by exception type), never silent. Failed publishes are counted the same way.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter

from flashpd.engine.sequence import Sequence
from flashpd.kv_bridge.chunk import CorruptChunk
from flashpd.kv_bridge.client import BridgeError
from flashpd.kv_bridge.prefix_cache import Fetched, Pending, PrefixCache

log = logging.getLogger(__name__)

# What a remote store raises when the bridge is unreachable, slow or sends bad bytes.
IMPORT_ERRORS = (BridgeError, ConnectionError, TimeoutError, CorruptChunk)


class GuardedPrefixCache:
    """A PrefixCache whose restore/publish survive a failing bridge (see the module doc)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.import_failures: Counter[str] = Counter()
        self.publish_failures: Counter[str] = Counter()
        # the engine thread, the load threads and the save thread count at once: `c[k] += 1` unlocked lost counts
        self._count_lock = threading.Lock()

    def _count(self, counts: Counter[str], e: BaseException) -> None:
        with self._count_lock:
            counts[type(e).__name__] += 1

    @property
    def stats(self):
        return self.cache.stats

    @property
    def chunk_tokens(self) -> int:
        return self.cache.chunk_tokens

    def restore(self, gen, seq: Sequence) -> int:
        try:
            return self.cache.restore(gen, seq)
        except IMPORT_ERRORS as e:
            self._count(self.import_failures, e)
            log.warning("KV import from the bridge failed (%s: %s); recomputing the %d-token prompt locally",
                        type(e).__name__, e, len(seq.prompt))
            # nothing restored (num_tokens and draft_len 0: the local prefill computes every position), and the
            # request counted as one whose prompt was a miss, as the fetch path counts it: prompt_tokens is what
            # the miss metric is made from
            return self.cache.apply(gen, seq, Fetched(len(seq.prompt)))

    def lookup_tokens(self, gen, prompt: list[int]) -> int:
        try:
            return self.cache.lookup_tokens(gen, prompt)
        except IMPORT_ERRORS:
            return 0

    def fetch(self, gen, prompt: list[int]) -> Fetched:
        """As PrefixCache.fetch; a failing bridge gives an empty fetch (counted, logged): recomputed."""
        try:
            return self.cache.fetch(gen, prompt)
        except IMPORT_ERRORS as e:
            self._count(self.import_failures, e)
            log.warning("KV import from the bridge failed (%s: %s); recomputing the %d-token prompt locally",
                        type(e).__name__, e, len(prompt))
            return Fetched(len(prompt))

    def apply(self, gen, seq: Sequence, got: Fetched) -> int:
        return self.cache.apply(gen, seq, got)

    def publish(self, gen, seq: Sequence) -> int:
        return self.store_pending(self.collect(gen, seq))

    def collect(self, gen, seq: Sequence) -> Pending:
        return self.cache.collect(gen, seq)

    def store_pending(self, p: Pending) -> int:
        try:
            return self.cache.store_pending(p)
        except IMPORT_ERRORS as e:
            self._count(self.publish_failures, e)
            log.warning("publishing a prompt to the bridge failed (%s: %s); not cached", type(e).__name__, e)
            return 0

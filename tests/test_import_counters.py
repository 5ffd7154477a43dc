"""The decode side's failure counters are counted from several threads at once (the engine thread, the load threads,
the save thread, the import threads): no count may be lost. A Counter subclass that lets other threads run between
the read and the write of `c[k] += 1` makes the race happen on every run instead of rarely."""
from __future__ import annotations

import threading

from flashpd.decode_node.bridge_import import GuardedPrefixCache
from flashpd.decode_node.handoff_import import HandoffImport
from flashpd.kv_bridge.client import BridgeError
from flashpd.kv_bridge.prefix_cache import Fetched
from tests._counters import SlowCounter

THREADS, EACH = 8, 25


def _hammer(fn) -> None:
    start, errors = threading.Barrier(THREADS), []

    def run() -> None:
        start.wait()
        try:
            for _ in range(EACH):
                fn()
        except Exception as e:  # noqa: BLE001  reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors


class FailingCache:
    """A PrefixCache whose bridge is gone: every fetch and store raises what a RemoteStore raises."""

    chunk_tokens = 16

    def fetch(self, gen, prompt):
        raise BridgeError("Get", "bridge unreachable")

    def store_pending(self, p):
        raise BridgeError("Get", "bridge unreachable")


def test_import_and_publish_failures_counted_from_many_threads_lose_no_count():
    g = GuardedPrefixCache(FailingCache())  # type: ignore[arg-type]
    g.import_failures, g.publish_failures = SlowCounter(), SlowCounter()
    _hammer(lambda: g.fetch(None, [1, 2, 3]))
    _hammer(lambda: g.store_pending(None))
    assert g.import_failures == {"BridgeError": THREADS * EACH}
    assert g.publish_failures == {"BridgeError": THREADS * EACH}
    assert isinstance(g.fetch(None, [1, 2]), Fetched)


def test_handoff_fallbacks_counted_from_many_threads_lose_no_count():
    h = HandoffImport(importer=None, release=lambda _: None)  # type: ignore[arg-type]
    h.fallbacks = SlowCounter()
    _hammer(lambda: h.fallback("lease 17 refused"))
    assert h.fallbacks == {"lease N refused": THREADS * EACH}

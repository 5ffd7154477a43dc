"""A scrape reads a decode worker's stats once for all its live families (cluster/worker_main.decode_metrics):
with the engine in its own process each read is a round trip, and a stuck engine made every family wait out its
own timeout (STATS_TIMEOUT_S each: 45 s a scrape)."""
from __future__ import annotations

import threading
import time

from flashpd.cluster.metrics import Metrics
from flashpd.cluster.worker_main import decode_metrics

STATS = {"waiting": 2, "running": 3, "kv_blocks_free": 7, "preemptions": 1, "handoff_imports": 0, "prefill_holds": 0,
         "handoff_fallbacks": 0, "jit_compiles_after_warmup": 0, "graph_captures_after_warmup": 0}


class _Worker:
    def __init__(self, delay_s: float, fail: bool = False) -> None:
        self.delay_s, self.fail, self.calls, self.cache, self.running = delay_s, fail, 0, None, 3

    def stats(self) -> dict:
        self.calls += 1
        time.sleep(self.delay_s)
        if self.fail:
            raise TimeoutError("the engine process did not answer")
        return {**STATS, "running": self.running}


def test_a_scrape_reads_the_stats_once():
    w = _Worker(0.05)
    m = Metrics("decode")
    decode_metrics(m, w)
    text = m.exposition()
    assert w.calls == 1
    assert 'flashpd_running_requests{role="decode"} 3.0' in text and 'flashpd_kv_blocks_free{role="decode"} 7.0' in text


def test_a_stuck_engine_costs_one_timeout_a_scrape():
    w = _Worker(0.3, fail=True)
    m = Metrics("decode")
    decode_metrics(m, w)
    t0 = time.monotonic()
    text = m.exposition()
    assert w.calls == 1 and time.monotonic() - t0 < 1.0  # 9 families: 2.7 s when each read for itself
    assert "flashpd_running_requests{" not in text  # the families are empty, and the scrape answers


def test_each_scrape_reads_afresh_and_one_reading_is_shared():
    """Two scrapes in a row read twice (no family shows an earlier scrape's value); the reads of one scrape's
    families, on several threads at once, make one call."""
    w = _Worker(0.0)
    m = Metrics("decode")
    decode_metrics(m, w)
    m.exposition()
    w.running = 9
    assert 'flashpd_running_requests{role="decode"} 9.0' in m.exposition() and w.calls == 2
    calls = []

    def slow() -> dict:
        calls.append(1)
        time.sleep(0.2)
        return {"n": len(calls)}

    read = m.per_scrape(slow)
    got = []
    threads = [threading.Thread(target=lambda: got.append(read())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert got == [{"n": 1}] * 4 and len(calls) == 1
    m.exposition()  # a new scrape
    assert read() == {"n": 2} and len(calls) == 2

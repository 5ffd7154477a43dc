"""A scrape reads a decode worker's stats once for all its live families (cluster/worker_main.decode_metrics):
with the engine in its own process each read is a round trip, and a stuck engine made every family wait out its
own timeout (STATS_TIMEOUT_S each: 45 s a scrape)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from flashpd.cluster.metrics import SECONDS, Metrics
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


def test_an_engine_process_is_read_once_a_scrape_with_its_cache_and_device_tier_families():
    """The colocated service's engine process (cluster/service.engine_metrics): its recompute-fallback and device
    tier families share the scrape's one read. They read for themselves, and a stopped engine made a scrape wait
    four timeouts (20 s)."""
    from flashpd.cluster.service import engine_metrics

    calls = []

    def stats() -> dict:
        calls.append(1)
        return {**STATS, "import_failures_by_reason": {"corrupt": 2},
                "device_store": {"hits_device": 5, "hits_backing": 1, "misses": 3, "bytes": 4096}}

    m = Metrics("colocated")
    engine_metrics(m, stats, has_cache=True, device_tier=True)
    text = m.exposition()
    assert len(calls) == 1, len(calls)
    assert 'flashpd_recompute_fallbacks_total{reason="corrupt",role="colocated"} 2.0' in text, text
    assert 'flashpd_device_cache_bytes{role="colocated"} 4096.0' in text
    assert 'flashpd_device_cache_reads_total{result="hit",role="colocated",tier="device"} 5.0' in text


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


# A process that ran before (a prefill worker that served 36 prefills), its counts in prometheus_client's multiprocess
# files as any process's are when PROMETHEUS_MULTIPROC_DIR is in its environment; prints its pid.
_DEAD = f"""
import os
from prometheus_client import CollectorRegistry, Counter, Histogram
r = CollectorRegistry()
ttft = Histogram("flashpd_ttft_seconds", "Time to first token", ["role", "method"], buckets={SECONDS!r}, registry=r)
requests = Counter("flashpd_requests", "Requests ended, by method and outcome", ["role", "method", "outcome"],
                   registry=r)
for _ in range(36):
    ttft.labels("prefill", "dflash").observe(0.03)
    requests.labels("prefill", "dflash", "ok").inc()
print(os.getpid())
"""

# A later process the kernel gave the dead one's pid (pids wrap; the directory outlives both): its files are this
# process's now. It counts 32 prefills and prints its exposition.
_REBORN = """
import os, shutil, sys
d, dead = sys.argv[1], sys.argv[2]
for f in os.listdir(d):
    if f.endswith(f"_{dead}.db"):
        shutil.copyfile(os.path.join(d, f), os.path.join(d, f.removesuffix(f"_{dead}.db") + f"_{os.getpid()}.db"))
from flashpd.cluster.metrics import Metrics
m = Metrics("prefill")
for _ in range(32):
    m.ttft.labels("prefill", "dflash").observe(0.03)
    m.requests.labels("prefill", "dflash", "ok").inc()
print(m.exposition())
"""


def test_counts_are_the_processs_own_when_the_environment_asks_for_prometheus_multiprocess_files(tmp_path):
    """LMCache sets PROMETHEUS_MULTIPROC_DIR for good in a process that builds its engine (a test's LMCacheStore),
    and every process started from there inherits it (a Ray cluster's actors, a local launcher's workers): with
    prometheus_client's Counter and Histogram those kept their values in files named by pid, and a worker that got a
    dead process's pid counted on from its totals (a CI failure: 68 prefills reported for 32)."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    dead = subprocess.run([sys.executable, "-c", _DEAD], env=env, capture_output=True, text=True, timeout=60)
    assert dead.returncode == 0, dead.stderr[-2000:]
    assert any(f.name.startswith("histogram_") for f in tmp_path.iterdir())  # what the dead process left there
    p = subprocess.run([sys.executable, "-c", _REBORN, str(tmp_path), dead.stdout.strip()], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert 'flashpd_ttft_seconds_count{method="dflash",role="prefill"} 32.0' in p.stdout, p.stdout
    assert 'flashpd_requests_total{method="dflash",outcome="ok",role="prefill"} 32.0' in p.stdout, p.stdout


def test_a_stuck_engine_is_logged_once_not_per_family_and_scrape(caplog):
    """Every live family of every scrape fails while the engine process is stuck: each logged an ERROR with its
    traceback (9 a scrape, found by a review). Now one line while the failure stays the same, one when it ends."""
    import logging  # noqa: PLC0415

    w = _Worker(0.0, fail=True)
    m = Metrics("decode")
    decode_metrics(m, w)
    with caplog.at_level(logging.INFO, logger="flashpd.cluster.metrics"):
        for _ in range(3):
            assert 'flashpd_running_requests{role="decode"}' not in m.exposition()  # left empty
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "the engine process did not answer" in errors[0].getMessage(), caplog.text
        assert "flashpd_running_requests" in errors[0].getMessage()  # the families are named
        w.fail = False
        assert 'flashpd_running_requests{role="decode"} 3.0' in m.exposition()
        m.exposition()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == ["metrics can be read again"]
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1

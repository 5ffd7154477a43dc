"""The colocated server with a device tier (device_cache_bytes > 0): a repeated prompt is a hit in the
same worker, restored from entries kept on the model's device, and gives the tokens AND acceptance
lengths of its first (cold) run. The first two read the cache's own counters, so their engine runs in the serving
process (engine_process false); the third reads what an engine process's service serves as metrics."""
from __future__ import annotations

from flashpd.cluster.generation_client import GenerationClient
from flashpd.cluster.service import start_service

from tests._cluster_helpers import dflash_pair, prompts, request_kw, serve_cfg, stream  # noqa: F401


def _twice_equal(svc, ps: list[list[int]]) -> None:
    """Each prompt twice (cold, then a hit), alternating methods (DFlash first): same tokens and acceptance."""
    runs = []
    with GenerationClient(svc.address, timeout_s=60) as c:
        for _ in range(2):
            runs.append([stream(c, p, **request_kw(i + 1)) for i, p in enumerate(ps)])
    for (t0, s0), (t1, s1) in zip(*runs):
        assert t0 == t1 and s0["acceptance_lengths"] == s1["acceptance_lengths"]


def test_repeated_prompts_hit_the_device_tier_and_equal_their_cold_runs(dflash_pair):  # noqa: F811
    svc = start_service(serve_cfg(dflash_pair, "colocated", device_cache_bytes=64 << 20, engine_process=False))
    try:
        ps = prompts()[:6]
        _twice_equal(svc, ps)
        cache = svc.worker.cache.cache
        st = cache.store.stats()
        chunk = cache.chunk_tokens
        assert cache.stats.per_request_hits == [0] * 6 + [((len(p) - 1) // chunk) * chunk for p in ps]
        assert st["hits_device"] == sum((len(p) - 1) // chunk for p in ps) and st["misses"] == 0
        assert st["entries"] == sum(len(p) // chunk for p in ps)
    finally:
        svc.stop()


def test_repeated_prompts_hit_the_pinned_host_tier_and_equal_their_cold_runs(dflash_pair):  # noqa: F811
    """host_cache_bytes alone: the colocated server's prefix cache is the host tier (pinned on a GPU)."""
    svc = start_service(serve_cfg(dflash_pair, "colocated", host_cache_bytes=64 << 20, engine_process=False))
    try:
        ps = prompts()[:4]
        _twice_equal(svc, ps)
        cache = svc.worker.cache.cache
        chunk = cache.chunk_tokens
        assert type(cache.store).__name__ == "HostStore"
        assert cache.stats.per_request_hits == [0] * 4 + [((len(p) - 1) // chunk) * chunk for p in ps]
        assert cache.store.stats()["allocations"] <= 1  # the arena, made before serving
    finally:
        svc.stop()


def test_an_engine_process_serves_its_device_tier_hits_and_metrics(dflash_pair):  # noqa: F811
    svc = start_service(serve_cfg(dflash_pair, "colocated", device_cache_bytes=64 << 20, engine_process=True))
    try:
        ps = prompts()[:4]
        _twice_equal(svc, ps)
        hits = sum((len(p) - 1) // svc.cfg.chunk_tokens for p in ps)
        assert hits > 0
        text = svc.metrics.exposition()
        assert f'flashpd_device_cache_reads_total{{result="hit",role="colocated",tier="device"}} {float(hits)}' in text
        assert 'flashpd_device_cache_reads_total{result="miss",role="colocated",tier="all"} 0.0' in text
    finally:
        svc.stop()

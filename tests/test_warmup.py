"""Worker warm-up (engine/warmup.py): throwaway requests at start run every method through the worker's
own scheduler, then leave no trace: every KV block free, nothing published to or read from the prefix
cache, counters zero, and the next requests' tokens and acceptance lengths as without a warm-up; the decode
warm-up steps every power-of-two batch bucket up to max_running that fits the cache."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.worker_main import wants_warmup
from flashpd.decode_node.worker import DecodeWorker
from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.decode_node.scheduler import Scheduler
from flashpd.engine import cuda_graph, device_loop
from flashpd.engine.runner_config import RunnerConfig
from flashpd.engine.warmup import batch_sizes, lengths_for, warm_prefill, warm_scheduler
from flashpd.kv_bridge.keys import MethodFingerprint
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.store import MemoryStore
from flashpd.prefill_node.worker import PrefillWorker

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)
from tests.test_decode_worker import _drain


def _models(pair):
    target = load_target(pair.target_dir)
    drafter = load_drafter(pair.draft_dir, target)
    return target, drafter, tuple(drafter.cfg.target_layer_ids)


def _cache(pair, drafter) -> PrefixCache:
    fp = MethodFingerprint("t", "d", tuple(drafter.cfg.target_layer_ids), "float32").digest()
    return PrefixCache(MemoryStore(1 << 30), fp, 32)


def test_decode_warmup_leaves_no_trace(dflash_pair):  # noqa: F811
    target, drafter, taps = _models(dflash_pair)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 126, (n,), generator=g).tolist() for n in (70, 150)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    results = {}
    for warm in (False, True):
        runner = ModelRunner(target, 256, 16, taps=taps)
        free = runner.allocator.num_free
        cache = _cache(dflash_pair, drafter)
        w = DecodeWorker(runner, drafter, prefix_cache=cache, warmup=warm)
        try:
            if warm:
                done = w.warmup
                assert done["methods"] == ["native", "dflash"] and done["requests"] >= 2 * len(done["lengths"])
                assert done["lengths"] == lengths_for(runner.max_positions, 33) and done["lengths"]
                # every batch bucket up to max_running (64), but 64 rows of short prompts do not fit 255 blocks
                assert done["batches"] == {m: [2, 4, 8, 16, 32] for m in ("native", "dflash")}, done
                assert done["skipped_batches"] == {m: [64] for m in ("native", "dflash")}
                assert done["hit_batches"] == {m: [1, 2] for m in ("native", "dflash")}, done  # a private cache's
            else:
                assert w.warmup is None
            assert runner.allocator.num_free == free
            st = cache.store.stats()
            assert st["entries"] == st["puts"] == st["misses"] == 0 and cache.stats.requests == 0, \
                "the warm-up touched the prefix cache"
            assert w.stats()["preemptions"] == 0
            results[warm] = [_drain(w.submit(p, params, m)) for p in prompts for m in ("native", "dflash")]
        finally:
            w.stop()
    assert [t for t, _ in results[True]] == [t for t, _ in results[False]]
    assert [s["acceptance_lengths"] for _, s in results[True]] == [s["acceptance_lengths"] for _, s in results[False]]


def test_prefill_warmup_publishes_nothing(dflash_pair):  # noqa: F811
    target, drafter, taps = _models(dflash_pair)
    runner = ModelRunner(target, 256, 16, taps=taps)
    cache = _cache(dflash_pair, drafter)
    worker = PrefillWorker(runner, drafter, cache)
    free = runner.allocator.num_free
    done = warm_prefill(worker.gen, lengths_for(runner.max_positions, 1))
    assert done["requests"] == len(done["lengths"]) > 0
    assert runner.allocator.num_free == free and cache.store.stats()["puts"] == 0


def test_a_prefill_warmup_that_fails_gives_its_blocks_back(dflash_pair, monkeypatch):  # noqa: F811
    target, drafter, taps = _models(dflash_pair)
    runner = ModelRunner(target, 64, 16, taps=taps)
    worker = PrefillWorker(runner, drafter, _cache(dflash_pair, drafter))
    free = runner.allocator.num_free

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(runner, "forward", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        warm_prefill(worker.gen, [40])
    assert runner.allocator.num_free == free


def test_warmup_setting():
    cpu = ModelRunner.__new__(ModelRunner)
    cpu.device = torch.device("cpu")
    assert not wants_warmup(ServeConfig(target="x"), cpu)  # default: GPUs only
    assert wants_warmup(ServeConfig(target="x", warmup=True), cpu)
    assert ServeConfig.from_dict({"target": "x", "warmup": False}).warmup is False
    assert lengths_for(300, 33) == [12, 13, 20, 40, 100, 200] and lengths_for(10, 33) == []
    assert batch_sizes(128) == [2, 4, 8, 16, 32, 64, 128] and batch_sizes(100) == [2, 4, 8, 16, 32, 64, 100]
    assert batch_sizes(2) == [2] and batch_sizes(1) == []


# a closed loop's sampling: greedy (the service sweep's), an HTTP request's default (temperature 1.0), and Qwen3's
# generation_config.json (which the HTTP API takes as its default: temperature 0.6, top-p 0.95, top-k 20)
LOOP_MODES = {"greedy": {}, "sampled": dict(temperature=1.0), "filtered": dict(temperature=0.6, top_p=0.95, top_k=20)}


def test_warmup_meets_a_chat_length_closed_loops_device_steps(dflash_pair, monkeypatch):  # noqa: F811
    """With the GPU's padded shapes (cuda_graphs=True runs each graphed function directly on the CPU), a closed loop
    of 8 requests in flight with 128-token prompts and 64 new tokens (the service sweep's), native then DFlash,
    greedy or sampled, meets no graph key (device-loop step: its mode's graph, batch bucket, width, table bucket;
    runner graph: packed input, batch, width, table, sink) that the warm-up did not: on a GPU each would be a graph
    captured while serving, with the batch waiting. Before the warm-up's 16-block and prefill passes the loop met
    (8, 1, 16), (8, 16, 16) and the smaller buckets, and the prefills of 2-8 prompts, for the first time; before the
    16-block pass ran every mode, a sampled loop met each bucket's sampled step at 16 blocks; before each prompt
    alone ran every mode, a sampled request alone met its step at each table bucket for the first time (a closed
    loop on an H100 stalled for seconds there: docs/results.md, forty-fifth session)."""
    seen: list[tuple] = []
    orig, orig_graphed = device_loop.InPlaceGraph.__call__, cuda_graph.GraphedFn.__call__

    def record(self, key, bufs, reset):
        seen.append((id(self), tuple(key)))
        return orig(self, key, bufs, reset)

    def record_graphed(self, inputs, **kw):  # GraphedFn's key: input shapes and the static kwargs
        seen.append((id(self), tuple(tuple(x.shape) for x in inputs),
                     tuple(sorted((k, getattr(v, "__qualname__", v)) for k, v in kw.items()))))
        return orig_graphed(self, inputs, **kw)

    monkeypatch.setattr(device_loop.InPlaceGraph, "__call__", record)
    monkeypatch.setattr(cuda_graph.GraphedFn, "__call__", record_graphed)
    target, drafter, taps = _models(dflash_pair)
    runner = ModelRunner(target, 640, 16, taps=taps, config=RunnerConfig(cuda_graphs=True, compile=False))
    sched = Scheduler(runner, drafter, (), None, 8, "preempt", None)
    done = warm_scheduler(sched, lengths_for(runner.max_positions, 33), 33)
    assert done["wide_table_batches"] == {m: [2, 4, 8] for m in ("native", "dflash")}, done
    assert done["prefill_batches"]["dflash"] == [(2, 64), (4, 64), (8, 64), (2, 128), (4, 128), (8, 128), (2, 256),
                                                 (4, 256), (2, 512)], done
    warm = set(seen)
    assert {k[1] for k in warm} >= {(b, 1, 16) for b in (2, 4, 8)}  # the 16-block pass, native's shapes
    g = torch.Generator().manual_seed(11)
    pool = [torch.randint(0, 126, (128,), generator=g).tolist() for _ in range(20)]
    for mode, method in [(m, k) for m in LOOP_MODES for k in ("native", "dflash")]:  # one warm-up for all
        params = SamplingParams(max_tokens=64, ignore_eos=True, **LOOP_MODES[mode])
        del seen[:]
        sent = finished = 0
        for _ in range(8):
            sched.add(pool[sent], params, method)
            sent += 1
        while finished < len(pool):
            for _ in sched.step().finished:
                finished += 1
                if sent < len(pool):
                    sched.add(pool[sent], params, method)
                    sent += 1
        for p in (pool[0], pool[1][:16]):  # one request alone (a first HTTP request): chat-length, then short
            sched.add(p, params, method)
            sched.run_until_idle()
        assert seen, f"{mode} {method}: no device-loop step ran (the check would be empty)"
        assert set(seen) <= warm, (mode, method, sorted(str(k[1:]) for k in set(seen) - warm))



def test_warmup_prefills_over_a_cached_prefix_at_one_and_two_rows(dflash_pair, monkeypatch):  # noqa: F811
    """Where a worker serves with a prefix cache, a hit's tail is a prefill over a cached prefix (fresh=False);
    before the warm-up's hit pass only a lone long prompt's chunks ran one, at one row, so the first hits of two
    requests admitted together compiled it (sizes 0 and 1 specialize: two dynamo graphs on the CPU's count) and
    captured its graph while serving. The pass runs through a private cache: the serving one stays empty, and a
    chat turn of two requests hitting the serving cache afterwards (the pass's geometry) meets no new graph key."""
    from flashpd.decode_node.worker import scratch_cache

    seen: list[tuple] = []
    orig_graphed = cuda_graph.GraphedFn.__call__

    def record_graphed(self, inputs, **kw):
        seen.append((id(self), tuple(tuple(x.shape) for x in inputs),
                     tuple(sorted((k, getattr(v, "__qualname__", v)) for k, v in kw.items()))))
        return orig_graphed(self, inputs, **kw)

    monkeypatch.setattr(cuda_graph.GraphedFn, "__call__", record_graphed)
    target, drafter, taps = _models(dflash_pair)
    runner = ModelRunner(target, 640, 16, taps=taps, config=RunnerConfig(cuda_graphs=True, compile=False))
    cache = _cache(dflash_pair, drafter)
    sched = Scheduler(runner, drafter, (), cache, 8, "preempt", None)
    done = warm_scheduler(sched, lengths_for(runner.max_positions, 33), 33, scratch_cache=scratch_cache(cache, sched))
    assert done["hit_batches"] == {m: [1, 2] for m in ("native", "dflash")}, done
    assert sched.prefix_cache is cache and cache.stats.requests == 0 and cache.store.stats()["puts"] == 0
    warm = set(seen)
    over_prefix = {(dict(k[2])["b"], dict(k[2])["sink"]) for k in warm if dict(k[2]).get("fresh") is False}
    assert {(2, None), (2, "DraftRunner.write_forward_context")} <= over_prefix, over_prefix
    g = torch.Generator().manual_seed(13)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for method in ("native", "dflash"):
        base = [torch.randint(0, 126, (cache.chunk_tokens + 24,), generator=g).tolist() for _ in range(2)]
        for group in (base, [p + torch.randint(0, 126, (24,), generator=g).tolist() for p in base]):
            for p in group:
                sched.add(p, params, method)
            sched.run_until_idle()
        assert cache.stats.per_request_hits[-2:] == [cache.chunk_tokens] * 2, cache.stats
    assert set(seen) <= warm, sorted(str(k[1:]) for k in set(seen) - warm)


def test_a_hit_pass_that_does_not_hit_is_not_counted(dflash_pair, caplog):  # noqa: F811
    """A private store that refuses every chunk (too small) leaves the hit pass without hits: it reports no batch
    and logs why, rather than claiming the prefill over a cached prefix was warmed; the serving cache is back."""
    target, drafter, taps = _models(dflash_pair)
    runner = ModelRunner(target, 640, 16, taps=taps)
    cache = _cache(dflash_pair, drafter)
    sched = Scheduler(runner, drafter, (), cache, 8, "preempt", None)
    tiny = PrefixCache(MemoryStore(4096), cache.fingerprint, cache.chunk_tokens)
    free = runner.allocator.num_free
    with caplog.at_level("WARNING", logger="flashpd.engine.warmup"):
        done = warm_scheduler(sched, [20], 33, max_batch=2, scratch_cache=tiny)
    assert done["hit_batches"] == {"native": [], "dflash": []}, done
    assert "did not all hit" in caplog.text and tiny.store.stats()["oversize_refused"] > 0
    assert sched.prefix_cache is cache and sched.async_load and runner.allocator.num_free == free


def test_llm_warmup_leaves_no_short_prompt_a_graph_to_capture(monkeypatch):
    """On an H100, after LLM's warm-up, first prompts of 5, 9, 20, 27, 31 and 45 tokens took 106-140 ms to their
    first token (a 12-token one 1 ms): each met a graph of its own width, captured inside its TTFT. Short prefills
    pad to 16, 32 or 64 now, and the warm-up meets those widths. Counted on the CPU with the GPU's graph paths."""
    import flashpd.llm as llm_mod
    from flashpd.engine import factory

    seen: set = set()
    loop_call, graph_call = device_loop.InPlaceGraph.__call__, cuda_graph.GraphedFn.__call__

    def loop_seen(self, key, bufs, reset):
        seen.add(("loop", tuple(key)))
        return loop_call(self, key, bufs, reset)

    def graph_seen(self, inputs, **kw):
        seen.add(("graph", id(self), tuple(tuple(x.shape) for x in inputs), tuple(sorted(map(str, kw.items())))))
        return graph_call(self, inputs, **kw)

    load = factory.load_engine
    monkeypatch.setattr(device_loop.InPlaceGraph, "__call__", loop_seen)
    monkeypatch.setattr(cuda_graph.GraphedFn, "__call__", graph_seen)
    monkeypatch.setattr(llm_mod, "load_engine", lambda *a, **kw: load(
        *a, **{**kw, "runner_config": RunnerConfig(cuda_graphs=True, compile=False)}))
    demo = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"
    llm = llm_mod.LLM(target=demo / "target", draft=demo / "drafter", device="cpu", dtype="float32", warmup=True)
    warm = set(seen)
    g = torch.Generator().manual_seed(3)
    new = {}
    for n in (2, 5, 9, 17, 27, 31, 33, 45, 64):
        seen.clear()
        ids = torch.randint(0, llm.model.cfg.vocab_size, (n,), generator=g).tolist()
        llm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))
        new[n] = len(seen - warm)
    assert new == dict.fromkeys(new, 0), new


def test_a_long_warmup_says_how_far_it_got(dflash_pair, monkeypatch, caplog):  # noqa: F811
    """On an H100 `serve` waited 225 s for its engine with no word of the warm-up's progress (a line only at its
    end); now a line at most every PROGRESS_S names the method, the phase and the requests run."""
    import logging

    import flashpd.engine.warmup as warmup_mod
    target, drafter, taps = _models(dflash_pair)
    monkeypatch.setattr(warmup_mod, "PROGRESS_S", 0.0)  # a line after every group
    runner = ModelRunner(target, 256, 16, taps=taps)
    with caplog.at_level(logging.INFO, logger="flashpd.engine.warmup"):
        w = DecodeWorker(runner, drafter, warmup=True)
        w.stop()
    lines = [m for m in caplog.messages if m.startswith("warm-up: ")]
    assert any(m.startswith("warm-up: native, prompts of each length: ") for m in lines), lines
    assert any(m.startswith("warm-up: dflash, batch bucket 32: ") for m in lines), lines
    assert "chat-length tables" in {m.split(", ")[1].split(":")[0] for m in lines}  # (no prefill graphs: CPU)
    counts = [int(m.split(": ")[2].split()[0]) for m in lines]
    assert counts == sorted(counts) and counts[-1] == w.warmup["requests"]

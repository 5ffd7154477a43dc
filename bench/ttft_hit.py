"""TTFT of a method-aware prefix hit against a cold prefill, at a real shape with dummy weights.

    python -m flashpd.bench.ttft_hit --config qwen3-8b --out bench/results/ttft_hit_h200.json     # GPU
    python -m flashpd.bench.ttft_hit --config tiny --device cpu --out /tmp/ttft_tiny.json         # a check

One DFlash generator (target + 5-layer drafter, dummy weights) serves every mode:
  cold     no prefix cache: the whole prompt is prefilled (the drafter's context is written after
           the first token, so it is not in this TTFT);
  device   hit in the worker's device-resident tier (kv_bridge/device_store.py): a device copy;
  host     hit in the worker's pinned host tier (kv_bridge/host_store.py): one host -> device DMA
           per chunk (its arena is allocated before the first run, as a worker would at startup);
  memory   hit in an in-process MemoryStore: both halves restored (checksum, host -> device);
  shm      hit from a bridge server in its own process, bytes through /dev/shm, gRPC for handles;
  grpc     the same server, bytes inline in gRPC frames;
  arena    hit from a bridge server in its own process that keeps its entries in a shared-memory arena
           (kv_bridge/arena.py): the reader maps it once and reads each chunk in place, gRPC for handles;
  lmcache  hit through the LMCache backend (kv_bridge/lmcache_store.py), in process; opt-in.
A hit restores the prompt's full chunks (the last token is always recomputed: its logits give
the first token) and prefills only the rest. Protocol (../shared/design/experiments.md): each
prompt is published once, every mode warms up once per prompt, then --reps rounds run the modes
interleaved; per prompt the median of each mode and the paired speedup cold / mode; across
prompts the geometric mean, median, min and max of those speedups. Each hit's restore (lookup,
fetch, verification, copy into both caches) is timed apart, with the GB/s it reached; the rest
of its TTFT is the prefill of the prompt's tail. Each mode's publish (its store empty of the prompt: what a
disaggregated prefill worker does before it answers) is timed once per prompt. Every timed run's tokens are compared with the
cold run's (exact k/n, first differing position): a check of the restore, since dummy weights
make the tokens themselves meaningless (and bf16 near-ties may flip on a GPU).
"""
from __future__ import annotations

import argparse
import os
import math
import statistics
import sys
import time

import torch

from flashpd.bench.bridge_throughput import start_server
from flashpd.bench.common import write_json
from flashpd.bench.dflash_step import drafter_config_for
from flashpd.engine.config import Qwen3Config, builtin_config_path, load_config
from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge import shm_pool
from flashpd.kv_bridge.client import BridgeClient, RemoteStore
from flashpd.kv_bridge.keys import MethodFingerprint
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.stage import DEFAULT_STAGE_BYTES
from flashpd.kv_bridge.store import MemoryStore
from flashpd.engine.scheduler import generate

MODES = ("cold", "device", "host", "memory", "shm", "grpc", "arena", "lmcache")
TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32)  # 8 layers: five distinct default taps


def target_config(name: str) -> Qwen3Config:
    return Qwen3Config.from_dict(TINY, source="tiny") if name == "tiny" else load_config(builtin_config_path(name))


def make_stores(modes: list[str], gen: DFlashGenerator, chunk: int, budget: int,
                pin_arenas: bool = False, shm_pool_bytes: int = shm_pool.DEFAULT_POOL_BYTES) -> tuple[dict, list]:
    """One store per hit mode; returns them and what to close afterwards. pin_arenas: the arena mode's reader
    page-locks the arena for the generator's device. shm_pool_bytes: the same-host clients' Put segment pool."""
    stores, closers = {}, []
    if "device" in modes:
        from flashpd.kv_bridge.device_store import DeviceStore
        stores["device"] = DeviceStore(budget, gen.runner.device)
    if "host" in modes:
        from flashpd.kv_bridge.host_store import HostStore
        from flashpd.kv_bridge.layout import ChunkLayout
        full = ChunkLayout.of_caches(gen.runner.cache.data, gen.drafts.cache.data, chunk, None)
        stores["host"] = HostStore(budget, gen.runner.device, slot_bytes=full.payload_bytes())
        stores["host"].reserve()
    if "memory" in modes:
        stores["memory"] = MemoryStore(budget)
    if {"shm", "grpc"} & set(modes):
        proc, address = start_server(budget)
        client = BridgeClient(address, timeout_s=600, shm_pool_bytes=shm_pool_bytes)
        closers += [client.close, lambda: (proc.terminate(), proc.wait(30))]
        for m in ("shm", "grpc"):
            if m in modes:
                stores[m] = RemoteStore(client, transport="shm" if m == "shm" else "inline")
    if "arena" in modes:
        proc_a, address_a = start_server(budget, arena=True)
        client_a = BridgeClient(address_a, timeout_s=600, pin_device=gen.runner.device if pin_arenas else None,
                                shm_pool_bytes=shm_pool_bytes)
        closers += [client_a.close, lambda: (proc_a.terminate(), proc_a.wait(30))]
        stores["arena"] = RemoteStore(client_a, transport="arena")
    if "lmcache" in modes:
        from flashpd.kv_bridge.lmcache_layout import PackedLayout
        from flashpd.kv_bridge.lmcache_store import LMCacheStore
        lm = LMCacheStore(PackedLayout.of_models(gen.runner.model.cfg, gen.drafter.cfg, chunk, gen.runner.dtype), budget)
        stores["lmcache"] = lm
        closers.append(lm.close)
    return stores, closers


class TimedPrefixCache(PrefixCache):
    """A PrefixCache that also times its restore (lookup, fetch, verify, copy into the caches):
    the part of a hit's TTFT that is the bridge's, the rest being the prefill of the tail."""

    restore_ms = 0.0
    publish_ms = 0.0

    def restore(self, gen, seq) -> int:
        t = time.perf_counter()
        hit = super().restore(gen, seq)
        if gen.runner.device.type == "cuda":
            torch.cuda.synchronize(gen.runner.device)
        self.restore_ms += (time.perf_counter() - t) * 1e3
        return hit

    def publish(self, gen, seq) -> int:
        """Timed too: a disaggregated prefill worker publishes before it answers, so this is on that TTFT's path."""
        t = time.perf_counter()
        n = super().publish(gen, seq)
        self.publish_ms += (time.perf_counter() - t) * 1e3
        return n


def run(gen: DFlashGenerator, prompt: list[int], params: SamplingParams, cache: TimedPrefixCache | None) -> dict:
    s = generate(gen, [prompt], [params], prefix_cache=cache)[0]
    return {"ttft_ms": s.stats.ttft_ms, "latency_ms": s.stats.latency_ms, "tokens": list(s.output),
            "hit_tokens": cache.stats.hit_tokens if cache is not None else 0,
            "restore_ms": cache.restore_ms if cache is not None else 0.0}


def wait_pinned(client: BridgeClient, timeout_s: float = 120.0) -> float:
    """After the first warm-up round (whose first Get mapped the arena): wait until the client's background
    page-locking of it is done, so that timed runs measure the steady state; returns the wait, reported."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        st = client.arena_stats()
        if st["pinned"] + st["pin_failed"] >= st["mapped"] >= 1:  # done, or failed (warned; copies stay pageable)
            break
        time.sleep(0.01)
    wait = time.perf_counter() - t0
    print(f"arena page-locking: {client.arena_stats()}, {wait:.2f} s after the first warm-up round", flush=True)
    return wait


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def paired(rows: list[dict], mode: str) -> dict:
    sp = [r["speedup"][mode] for r in rows]
    return {"geomean": math.exp(statistics.mean(math.log(x) for x in sp)), "median": statistics.median(sp),
            "min": min(sp), "max": max(sp)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="TTFT: cold prefill vs method-aware prefix hit")
    ap.add_argument("--config", default="qwen3-8b", help="qwen3-4b, qwen3-8b, qwen3-32b, or tiny (a CPU check)")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=2723)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=4, help=">= 2, so that a cold run publishes both halves")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per cache entry")
    ap.add_argument("--modes", default="cold,device,memory,shm,grpc", help=f"comma list of {','.join(MODES)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--arena-pin", choices=("auto", "off"), default="auto",
                    help="page-lock the arena mode's mapping for the GPU's copies (auto: on a CUDA device)")
    ap.add_argument("--shm-pool-mib", type=int, default=shm_pool.DEFAULT_POOL_BYTES >> 20,
                    help="the shm and arena modes' pool of pre-allocated Put segment files (kv_bridge/shm_pool.py; "
                         "0: none)")
    ap.add_argument("--stage-mib", type=int, default=DEFAULT_STAGE_BYTES >> 20,
                    help="device memory a restore may fill with chunks copied to the GPU while the next is read "
                         "(kv_bridge/stage.py; 0: each chunk copied from the host when written, as before)")
    ap.add_argument("--out", default="bench/results/ttft_hit.json")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if "cold" not in modes or not set(modes) <= set(MODES) or a.new_tokens < 2:
        ap.error(f"--modes must include cold and be among {MODES}; --new-tokens >= 2")
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    cfg = target_config(a.config)
    target = dummy_target(cfg, a.device, dtype)
    drafter = dummy_drafter(drafter_config_for(cfg, a.draft_layers), target)
    blocks = 2 * (a.prompt_tokens + a.new_tokens + 64) // 16 + 64
    gen = DFlashGenerator(ModelRunner(target, blocks, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter, (), 16)
    item = torch.empty((), dtype=dtype).element_size()
    per_token = (cfg.num_hidden_layers + a.draft_layers) * 2 * cfg.num_key_value_heads * cfg.head_dim * item
    budget = a.prompts * a.prompt_tokens * per_token * 3 // 2 + (64 << 20)
    fp = MethodFingerprint(f"dummy-{a.config}", f"dummy-drafter-{a.draft_layers}", tuple(drafter.cfg.target_layer_ids),
                           str(dtype).removeprefix("torch.")).digest()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size - 2, (a.prompt_tokens,), generator=g).tolist() for _ in range(a.prompts)]
    params = SamplingParams(max_tokens=a.new_tokens, ignore_eos=True)
    hit_modes = [m for m in modes if m != "cold"]
    pin = a.arena_pin == "auto" and a.device.startswith("cuda")
    stores, closers = make_stores(hit_modes, gen, a.chunk, budget, pin, a.shm_pool_mib << 20)
    arena_pin_wait_s = None
    rows = []
    try:
        run(gen, prompts[0][:64], params, None)  # process warm-up (allocator, kernels)
        for i, p in enumerate(prompts):
            publish = {}
            for m in hit_modes:  # publish: a cold run with the store as its prefix cache
                pc = TimedPrefixCache(stores[m], fp, a.chunk, stage_bytes=a.stage_mib << 20)
                run(gen, p, params, pc)
                publish[m] = pc.publish_ms
            samples: dict[str, list[dict]] = {m: [] for m in modes}
            for rep in range(a.reps + 1):  # round 0 is this prompt's warm-up
                for m in modes:
                    pc = TimedPrefixCache(stores[m], fp, a.chunk, stage_bytes=a.stage_mib << 20) if m != "cold" else None
                    r = run(gen, p, params, pc)
                    if rep:
                        samples[m].append(r)
                if pin and "arena" in stores and arena_pin_wait_s is None:
                    arena_pin_wait_s = wait_pinned(stores["arena"].client)
            med = {m: statistics.median(r["ttft_ms"] for r in samples[m]) for m in modes}
            restore = {m: statistics.median(r["restore_ms"] for r in samples[m]) for m in hit_modes}
            base = samples["cold"][0]["tokens"]
            row = {"prompt": i, "prompt_tokens": len(p), "ttft_median_ms": med,
                   "speedup": {m: med["cold"] / med[m] for m in hit_modes},
                   "restore_median_ms": restore,
                   "publish_ms": publish,  # the prompt's chunks put into an empty store (one run, not a median)
                   "restore_gb_per_s": {m: samples[m][0]["hit_tokens"] * per_token / restore[m] / 1e6 for m in hit_modes},
                   "hit_tokens": {m: samples[m][0]["hit_tokens"] for m in hit_modes},
                   "exact_vs_cold": {m: f"{sum(r['tokens'] == base for r in samples[m])}/{len(samples[m])}" for m in modes},
                   "first_diff": {m: [first_diff(r["tokens"], base) for r in samples[m] if r["tokens"] != base]
                                  for m in modes},
                   "samples": {m: [r["ttft_ms"] for r in samples[m]] for m in modes},
                   "latency_ms": {m: [r["latency_ms"] for r in samples[m]] for m in modes}}
            rows.append(row)
            print(f"prompt {i} ({len(p)} tok): " + " | ".join(
                f"{m} {med[m]:.1f} ms" + (f" (x{row['speedup'][m]:.2f}, restore {restore[m]:.1f} ms, "
                                          f"publish {publish[m]:.1f} ms)" if m != "cold" else "")
                for m in modes), flush=True)
        arena_end = stores["arena"].client.arena_stats() if "arena" in stores else {}
        pools = {m: stores[m].client.shm_pool_stats() for m in ("shm", "arena") if m in stores}
    finally:
        for close in closers:
            close()
    summary = {m: paired(rows, m) for m in hit_modes}
    tiers = {m: stores[m].stats() for m in ("device", "host") if m in stores}  # in-process: counters, allocations
    if "arena" in stores:
        tiers["arena"] = {"pin": pin, "pin_wait_s": arena_pin_wait_s, **arena_end}
    for m, st in pools.items():  # the Put segment pool's writes (pooled or fresh) over the whole run
        tiers.setdefault(m, {})["shm_pool"] = {"bytes": a.shm_pool_mib << 20, **st}
    for m in hit_modes:
        print(f"{m}: speedup over cold geomean x{summary[m]['geomean']:.2f} (min {summary[m]['min']:.2f}, "
              f"max {summary[m]['max']:.2f})")
    cmd = "python -m flashpd.bench.ttft_hit " + " ".join(sys.argv[1:] if argv is None else argv)
    write_json(a.out, {"loadavg_after": os.getloadavg(), "bench": "ttft_hit", "config": a.config, "draft_layers": a.draft_layers, "weights": "dummy",
                       "device": a.device, "dtype": str(dtype).removeprefix("torch."), "chunk_tokens": a.chunk,
                       "stage_bytes": a.stage_mib << 20,
                       "bytes_per_token_both_halves": per_token, "reps": a.reps, "modes": modes, "rows": rows,
                       "summary": summary, "tier_stats": tiers, "command": cmd})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

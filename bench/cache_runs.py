"""Cold prefill vs a method-aware hit through every cache tier, vs the target-only control.

    python -m flashpd.bench.cache_runs --device cuda --prompts 20 --prompt-tokens 2048 --out bench/results/cache_runs_h200.json

Per prompt (held-out text the demo pair never trained on): a cold run, then, for each store
(memory, device, disk after a reopen, gRPC bridge on 127.0.0.1 inline and through shared memory,
LMCache when --stores names it), a cold run that publishes into it and a hit from it; and the
target-only control (drafter state deliberately NOT restored, as generic connectors do). Each hit
is compared with the first cold run: same tokens, and the same per-step acceptance lengths (the
bridge's promise). TTFT, tau and hit tokens per mode; in float32 they must all match, in bfloat16
on a GPU the match rates are what is reported.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch

from flashpd.bench.common import write_json
from flashpd.demo import PAIR
from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.keys import MethodFingerprint, weights_identity
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.store import MemoryStore
from flashpd.engine.scheduler import generate

STORES = ("memory", "device", "disk", "grpc", "shm", "lmcache")


def open_stores(names: list[str], gen: DFlashGenerator, chunk: int, budget: int, stack: ExitStack) -> dict:
    """name -> (store to publish into, store to hit from): the disk tier is reopened (a restart's view),
    the bridge is a real gRPC server on 127.0.0.1 with separate publishing and importing clients."""
    out = {}
    if "memory" in names:
        m = MemoryStore(budget)
        out["memory"] = (m, m)
    if "device" in names:
        from flashpd.kv_bridge.device_store import DeviceStore
        d = DeviceStore(budget, gen.runner.device)
        out["device"] = (d, d)
    if "disk" in names:
        from flashpd.kv_bridge.disk import DiskStore
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flashpd-cache-runs-")))
        out["disk"] = (DiskStore(root, budget), None)  # the hit side opens the directory after the cold run
        out["disk_root"] = root
    if {"grpc", "shm"} & set(names):
        from flashpd.kv_bridge.client import BridgeClient, RemoteStore
        from flashpd.kv_bridge.server import serve
        server, port = serve(MemoryStore(budget))
        stack.callback(lambda: server.stop(grace=None).wait(10))
        pub = stack.enter_context(BridgeClient(f"127.0.0.1:{port}", timeout_s=600))
        imp = stack.enter_context(BridgeClient(f"127.0.0.1:{port}", timeout_s=600))
        for m in ("grpc", "shm"):
            if m in names:
                out[m] = (RemoteStore(pub), RemoteStore(imp, transport="shm" if m == "shm" else "inline"))
    if "lmcache" in names:
        from flashpd.kv_bridge.lmcache_layout import PackedLayout
        from flashpd.kv_bridge.lmcache_store import LMCacheStore
        lm = stack.enter_context(LMCacheStore(PackedLayout.of_models(gen.runner.model.cfg, gen.drafter.cfg, chunk,
                                                                     gen.runner.dtype), budget))
        out["lmcache"] = (lm, lm)
    return out


def _run(gen, p, params, pc) -> dict:
    s = generate(gen, [p], params, prefix_cache=pc)[0]
    return {"ttft_ms": s.stats.ttft_ms, "latency_ms": s.stats.latency_ms, "tau": s.stats.tau,
            "hit_tokens": pc.stats.hit_tokens if pc is not None else 0, "tokens": s.output,
            "acceptance_lengths": s.stats.acceptance_lengths}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(PAIR / "target"))
    ap.add_argument("--draft", default=str(PAIR / "drafter"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--stores", default="memory,device,disk,grpc,shm", help=f"comma list of {','.join(STORES)}")
    ap.add_argument("--out", default="bench/results/cache_runs.json")
    a = ap.parse_args()
    names = [x for x in a.stores.split(",") if x]
    if not set(names) <= set(STORES):
        ap.error(f"--stores: choose from {STORES}")
    a.target, a.draft = (os.path.relpath(x) if not os.path.relpath(x).startswith("..") else x for x in (a.target, a.draft))
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    target = load_target(a.target, a.device, dtype)
    drafter = load_drafter(a.draft, target)
    tok_file = Path(a.target) / "tokenizer.json"
    if tok_file.exists():
        from tokenizers import Tokenizer
        from flashpd.training.demo_recipe import heldout_long_prompts
        prompts = heldout_long_prompts(Tokenizer.from_file(str(tok_file)), a.prompts, a.prompt_tokens)
    else:  # a tokenizer-less pair (the tests' fixture pair): seeded random token prompts
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.cfg.vocab_size - 2, (a.prompt_tokens,), generator=g).tolist()
                   for _ in range(a.prompts)]
    fp = MethodFingerprint(weights_identity(a.target), weights_identity(a.draft), tuple(drafter.cfg.target_layer_ids),
                           str(dtype).removeprefix("torch.")).digest()
    params = [SamplingParams(max_tokens=a.new_tokens, ignore_eos=True)]
    runner = ModelRunner(target, num_blocks=(a.prompt_tokens + a.new_tokens) // 16 * 2 + 64, kv_block_size=16,
                         taps=tuple(drafter.cfg.target_layer_ids))
    gen = DFlashGenerator(runner, drafter, (), 16)
    generate(gen, [prompts[0][:64]], params)  # warm-up
    item = torch.empty((), dtype=dtype).element_size()
    per_token = (target.cfg.num_hidden_layers + drafter.cfg.num_hidden_layers) * 2 * target.cfg.num_key_value_heads \
        * target.cfg.head_dim * item
    budget = a.prompts * a.prompt_tokens * per_token * 2 + (64 << 20)
    modes = names + ["target_only"]
    rows = []
    with ExitStack() as stack:
        stores = open_stores(names, gen, a.chunk, budget, stack)
        control = MemoryStore(budget)
        for i, p in enumerate(prompts):
            cold = _run(gen, p, params, None)
            row = {"prompt": i, "prompt_len": len(p), "cold": cold}
            for m in modes:
                if m == "target_only":
                    _run(gen, p, params, PrefixCache(control, fp, a.chunk))
                    hit = _run(gen, p, params, PrefixCache(control, fp, a.chunk, restore_draft=False))
                else:
                    pub, imp = stores[m]
                    _run(gen, p, params, PrefixCache(pub, fp, a.chunk))
                    if m == "disk":
                        from flashpd.kv_bridge.disk import DiskStore
                        imp = DiskStore(stores["disk_root"], budget)
                    hit = _run(gen, p, params, PrefixCache(imp, fp, a.chunk))
                hit["same_tokens"] = hit["tokens"] == cold["tokens"]
                hit["same_acceptance"] = hit["acceptance_lengths"] == cold["acceptance_lengths"]
                row[m] = hit
            rows.append(row)
            print(f"prompt {i} ({len(p)} tok): cold ttft {cold['ttft_ms']:.1f} ms tau {cold['tau']:.2f} | " + " | ".join(
                f"{m}: ttft {row[m]['ttft_ms']:.1f} ms, tau {row[m]['tau']:.2f}, hit {row[m]['hit_tokens']}, "
                f"tokens {'=' if row[m]['same_tokens'] else '!='}, acceptance {'=' if row[m]['same_acceptance'] else '!='}"
                for m in modes), flush=True)
    for r in rows:  # the JSON keeps lengths and verdicts, not every token
        for m in ["cold"] + modes:
            r[m].pop("tokens")
    summary = {"cold": {"tau_mean": statistics.mean(r["cold"]["tau"] for r in rows),
                        "ttft_median_ms": statistics.median(r["cold"]["ttft_ms"] for r in rows)}}
    for m in modes:
        summary[m] = {"tau_mean": statistics.mean(r[m]["tau"] for r in rows),
                      "ttft_median_ms": statistics.median(r[m]["ttft_ms"] for r in rows),
                      "same_tokens": f"{sum(r[m]['same_tokens'] for r in rows)}/{len(rows)}",
                      "same_acceptance": f"{sum(r[m]['same_acceptance'] for r in rows)}/{len(rows)}"}
    write_json(a.out, {"bench": "cache_runs", "device": a.device, "dtype": str(dtype).removeprefix("torch."),
                       "chunk_tokens": a.chunk, "new_tokens": a.new_tokens, "rows": rows, "summary": summary,
                       "pair": {"target": a.target, "draft": a.draft},
                       "command": f"python -m flashpd.bench.cache_runs --target {a.target} --draft {a.draft} --device {a.device} "
                                  f"--prompts {a.prompts} --prompt-tokens {a.prompt_tokens} --new-tokens {a.new_tokens} "
                                  f"--chunk {a.chunk} --stores {a.stores} --out {a.out}"})
    for m, v in summary.items():
        print(m, v)


if __name__ == "__main__":
    main()

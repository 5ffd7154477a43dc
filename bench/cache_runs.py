"""Cold prefill vs method-aware cache hit vs target-only hit (the control): TTFT, latency, tau.

    python -m flashpd.bench.cache_runs --target DIR --draft DIR --out bench/results/cache_runs.json

Each prompt is run cold (publishing its chunks), then as a method-aware hit (target KV + drafter
state restored) and as a target-only hit (drafter state deliberately NOT restored, as generic
connectors do). Tokens must match the cold run in both; tau shows what the control loses.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from flashpd.bench.common import write_json
from flashpd.demo import PAIR, heldout_prompts
from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.engine.tokenizer import TextTokenizer
from flashpd.kv_bridge.keys import MethodFingerprint, weights_identity
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.store import MemoryStore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(PAIR / "target"))
    ap.add_argument("--draft", default=str(PAIR / "drafter"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default="bench/results/cache_runs.json")
    a = ap.parse_args()
    a.target, a.draft = (os.path.relpath(x) if not os.path.relpath(x).startswith("..") else x for x in (a.target, a.draft))
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    target = load_target(a.target, a.device, dtype)
    drafter = load_drafter(a.draft, target)
    tok = TextTokenizer.from_dir(a.target)
    if tok is not None:
        prompts = heldout_prompts(tok.encode, n=a.prompts, tokens=a.prompt_tokens)
    else:  # a tokenizer-less pair (the tests' fixture pair): seeded random token prompts
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.cfg.vocab_size - 2, (a.prompt_tokens,), generator=g).tolist()
                   for _ in range(a.prompts)]
    fp = MethodFingerprint(weights_identity(a.target), weights_identity(a.draft), tuple(drafter.cfg.target_layer_ids),
                           str(dtype).removeprefix("torch.")).digest()
    store = MemoryStore(8 << 30)
    params = [SamplingParams(max_tokens=a.new_tokens, ignore_eos=True)]
    runner = ModelRunner(target, num_blocks=(a.prompt_tokens + a.new_tokens) // 16 * 2 + 64, block_size=16,
                         taps=tuple(drafter.cfg.target_layer_ids))
    gen = DFlashGenerator(runner, drafter, (), 16)
    gen.generate([prompts[0][:64]], params)  # warm-up
    rows = []
    for i, p in enumerate(prompts):
        row = {"prompt": i, "prompt_len": len(p)}
        base = None
        for mode in ("cold", "method_aware_hit", "target_only_hit"):
            pc = PrefixCache(store, fp, a.chunk, restore_draft=mode != "target_only_hit")
            s = gen.generate([p], params, prefix_cache=pc)[0]
            base = base or s.output
            row[mode] = {"ttft_ms": s.stats.ttft_ms, "latency_ms": s.stats.latency_ms, "tau": s.stats.tau,
                         "hit_tokens": pc.stats.hit_tokens, "exact_vs_cold": s.output == base,
                         "acceptance_lengths": s.stats.acceptance_lengths}
        rows.append(row)
        print(f"prompt {i} ({len(p)} tok): " + " | ".join(
            f"{m}: ttft {row[m]['ttft_ms']:.1f} ms, tau {row[m]['tau']:.2f}, exact {row[m]['exact_vs_cold']}"
            for m in ("cold", "method_aware_hit", "target_only_hit")), flush=True)
    summary = {m: {"tau_mean": statistics.mean(r[m]["tau"] for r in rows),
                   "ttft_median_ms": statistics.median(r[m]["ttft_ms"] for r in rows)}
               for m in ("cold", "method_aware_hit", "target_only_hit")}
    write_json(a.out, {"bench": "cache_runs", "device": a.device, "dtype": str(dtype).removeprefix("torch."),
                       "chunk_tokens": a.chunk, "rows": rows, "summary": summary,
                       "pair": {"target": a.target, "draft": a.draft},
                       "command": f"python -m flashpd.bench.cache_runs --target {a.target} --draft {a.draft} --device {a.device} --prompts {a.prompts} "
                                  f"--prompt-tokens {a.prompt_tokens} --new-tokens {a.new_tokens} --chunk {a.chunk} "
                                  f"--out {a.out}"})
    print(summary)


if __name__ == "__main__":
    main()

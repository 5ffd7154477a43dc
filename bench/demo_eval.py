"""Held-out tau and DFlash-vs-native exactness of a demo pair, on any device and dtype.

    python -m flashpd.bench.demo_eval --device cpu --dtype float32 --out bench/results/demo_pair_eval_cpu_fp32.json

The prompts are the recipe's own evaluation prompts (training/demo_recipe.heldout_windows), so a float32
CPU run checks, token for token, the exactness the recipe reports in bfloat16 on the GPU.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from flashpd.bench.common import write_json
from flashpd.demo import PAIR
from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.token_map import load_token_map
from flashpd.training.demo_recipe import heldout_windows
from flashpd.training.train_drafter import evaluate_tau


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default=str(PAIR), help="directory with target/ and drafter/")
    ap.add_argument("--drafter", help="a drafter directory for the pair's target (default: the pair's drafter/): "
                                      "candidates compare on one target and one prompt set")
    ap.add_argument("--token-map", help="a reduced draft vocabulary (engine/token_map.py; build one with "
                                        "python -m flashpd.training.token_map): tau under it, output still exact")
    ap.add_argument("--draft-quantization", choices=["fp8"], help="the drafter's few-row passes in this weight "
                                                                   "format (DFlashDrafter.quantize): tau under it")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/demo_pair_eval.json")
    a = ap.parse_args()
    pair = Path(a.pair)
    target = load_target(pair / "target", a.device, getattr(torch, a.dtype))
    drafter = load_drafter(a.drafter or pair / "drafter", target)
    if a.token_map:
        drafter.set_token_map(load_token_map(a.token_map, target.cfg.vocab_size))
    drafter.quantize(a.draft_quantization)
    prompts = heldout_windows(Tokenizer.from_file(str(pair / "target" / "tokenizer.json")), a.prompts, a.seed)
    t0 = time.perf_counter()
    rows = []
    for i, p in enumerate(prompts):  # one at a time: progress, and batch-1 numerics as served
        rows += evaluate_tau(target, drafter, [p], max_tokens=a.max_tokens, batch=1)
        r = rows[-1]
        print(f"prompt {i:2d} ({r['prompt_len']:4d} tokens): tau {r['tau']:.2f} exact {r['exact']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    taus = [r["tau"] for r in rows]
    payload = {"bench": "demo_eval", "pair": str(a.pair), "drafter": a.drafter, "device": a.device, "dtype": a.dtype, "block_size": 16,
               "token_map": a.token_map, "draft_vocab": None if drafter.hot_ids is None else drafter.hot_ids.numel(),
               "draft_quantization": a.draft_quantization,
               "max_tokens": a.max_tokens, "prompts": rows, "tau_mean": statistics.mean(taus),
               "tau_geomean": statistics.geometric_mean(taus),
               "tau_64_mean": statistics.mean(r["tau_64"] for r in rows), "exact": f"{sum(r['exact'] for r in rows)}/{len(rows)}",
               "command": f"python -m flashpd.bench.demo_eval --device {a.device} --dtype {a.dtype} "
                          f"--prompts {a.prompts} --max-tokens {a.max_tokens} --seed {a.seed}"
                          + (f" --drafter {a.drafter}" if a.drafter else "")
                          + (f" --token-map {a.token_map}" if a.token_map else "")
                          + (f" --draft-quantization {a.draft_quantization}" if a.draft_quantization else "")
                          + f" --out {a.out}"}
    write_json(Path(a.out), payload)
    print(f"tau mean {payload['tau_mean']:.2f} (geomean {payload['tau_geomean']:.2f}, first 64 tokens "
          f"{payload['tau_64_mean']:.2f}), exact {payload['exact']}")


if __name__ == "__main__":
    main()

"""The paged decode kernel's key split against batch size: how many keys one program walks.

    python -m flashpd.bench.paged_split --batches 1,4,32,128 --splits 64,128,256,512 --context 282 \
        --tiles m16-n32-w4-s2,m16-n64-w4-s2 --out bench/results/paged_split.json

At the Qwen3-8B head shape (8 KV heads, 4 query heads each, head dim 128, bf16, 16-token pages) a decode step's
kernel runs one program per (KV head, row) and key split (engine/paged_attention.py). With KEYS_PER_SPLIT 512 a
context under 512 keys is one split, so batch 4 runs 32 programs on a 132-SM GPU. This times one call (a CUDA
graph of 36 calls, one per layer, replayed) for each batch and split size, with every row at `context` keys,
and reports microseconds a call, the KV bytes it reads, and that as GB/s. Changing the split size changes a
row's bits (a different merge), never their dependence on the batch. `--tiles` adds tile shapes (rows, keys an
iteration, warps, stages; the engine's constants first); a "gather" row per batch times the plain-PyTorch path
(`paged_attention.reference` in bf16, eager; the engine compiles and fuses part of it), which decode took
at batches 1-3 before the kernel ran every decode and verify.
"""
from __future__ import annotations

import argparse

import torch

from flashpd.bench.attn_micro import graph_time
from flashpd.bench.common import git_revision, machine, write_json
from flashpd.engine import paged_attention as pa


def case(b: int, context: int, hkv: int = 8, groups: int = 4, d: int = 128, page: int = 16, seed: int = 0):
    """q [Hkv, B, G, d], caches, block tables (each row its own blocks, padded to a multiple of 4 blocks as the
    engine buckets them) and positions [B, 1] = context - 1."""
    used = -(-context // page)
    nblk = -(-used // 4) * 4
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(hkv, b, groups, d, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(b * used + 1, page, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.zeros(b, nblk, dtype=torch.int64, device="cuda")
    tables[:, :used] = 1 + torch.arange(b * used, device="cuda").view(b, used)
    pos = torch.full((b, 1), context - 1, dtype=torch.int64, device="cuda")
    return q, k, v, tables, pos


def tile(spec: str) -> dict[str, int]:
    """"m64-n32-w4-s2" -> launch's tile arguments."""
    names = {"m": "block_m", "n": "block_n", "w": "num_warps", "s": "num_stages"}
    return {names[p[0]]: int(p[1:]) for p in spec.split("-")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,32,128")
    ap.add_argument("--splits", default="64,128,256,512")
    ap.add_argument("--context", type=int, default=282)
    ap.add_argument("--tiles", default=f"m{pa.BLOCK_M}-n{pa.BLOCK_N}-w{pa.NUM_WARPS}-s{pa.NUM_STAGES}")
    ap.add_argument("--out", default="bench/results/paged_split.json")
    a = ap.parse_args()
    rows = []
    scale = 128 ** -0.5
    for b in (int(x) for x in a.batches.split(",")):
        q, k, v, bt, pos = case(b, a.context)
        kv_bytes = 2 * b * a.context * k.shape[2] * k.shape[3] * k.element_size()
        ref = pa.reference(q.float(), k.float(), v.float(), bt, pos, scale)
        configs = [("gather", None, lambda: pa.reference(q, k, v, bt, pos, scale))]
        for spec in a.tiles.split(","):
            for kps in (int(x) for x in a.splits.split(",")):
                if kps % tile(spec)["block_n"] == 0:
                    configs.append((spec, kps, lambda spec=spec, kps=kps: pa.launch(q, k, v, bt, pos, scale, kps,
                                                                                      **tile(spec))))
        for spec, kps, fn in configs:
            try:
                us = graph_time(fn, reps=20, inner=36)
                err = (fn().float() - ref).abs().max().item()
            except Exception as e:  # a tile shape the GPU cannot hold: reported, the sweep goes on
                print(f"b={b:4d} {spec} kps={kps}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            rows.append({"batch": b, "tiles": spec, "keys_per_split": kps,
                         "splits": None if kps is None else -(-bt.shape[1] * 16 // kps), "us_per_call": us,
                         "kv_bytes": kv_bytes, "gb_per_s": kv_bytes / us / 1e3, "max_abs_err_vs_fp32": err})
            print(f"b={b:4d} {spec:14s} kps={kps}: {us:7.2f} us a call, {kv_bytes / us / 1e3:7.1f} GB/s, "
                  f"err {err:.2e}", flush=True)
            write_json(a.out, {"bench": "paged_split", "git": git_revision(), "machine": machine(),
                               "command": "python -m flashpd.bench.paged_split " + " ".join(
                                   f"--{k_.replace('_', '-')} {v_}" for k_, v_ in vars(a).items()),
                               "context": a.context, "rows": rows})


if __name__ == "__main__":
    main()

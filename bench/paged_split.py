"""The paged decode kernel's key chunk and split against batch size.

    python -m flashpd.bench.paged_split --batches 1,4,16,32,128 --chunks 64,128 --context 282 \
        --out bench/results/paged_split.json

At the Qwen3-8B head shape (8 KV heads, 4 query heads each, head dim 128, bf16, 16-token pages) a decode step's
kernel (engine/paged_attention.py) merges a row's keys chunk by chunk, either all in one program per (KV head, row)
or with a program per chunk and a combine kernel ("split"). This times one call of `--width` tokens a row (1: a
decode, 16: a verify's block) in a CUDA graph of 36 calls, one per layer, replayed, for each batch, chunk size and
mode, with every row at `context` keys. It reports microseconds a call, the KV bytes it reads, and that as GB/s, and
whether a row's bits are the same as with the first tile shape at the same chunk size. The chunk size changes a
row's bits; the mode never does (each row's output is compared bitwise across the modes). `--tiles` adds tile
shapes (rows, keys an iteration, warps, stages; the engine's constants first); a "gather" row per batch times the
plain-PyTorch path (`paged_attention.reference` in bf16, eager). `--layouts nhd,hnd` also times the kernel over a
cache laid out head-major within each block (a KV head's 16 keys of a page contiguous), the same values, which the
kernel reads through its strides: whether the layout is worth changing the cache for.

By default the 36 calls read the same K/V, which then stays in L2 at small batches (and partly at large ones); in a
step the weights stream through L2 between layers and each layer's K/V come from memory. So a row here can favour a
mode that loses in the step (a verify without the split: docs/results.md); `--distinct 36` gives each call of the
graph its own copy of the cache, as a step's layers have; speed_8b decides.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from flashpd.bench.attn_micro import graph_time
from flashpd.bench.common import command_line, git_revision, machine, write_json
from flashpd.engine import paged_attention as pa


def case(b: int, context: int, width: int = 1, hkv: int = 8, groups: int = 4, d: int = 128, page: int = 16,
         seed: int = 0, table_blocks: int = 0):
    """q [Hkv, B, width*G, d], caches, block tables (each row its own blocks, padded to a multiple of 4 blocks, or
    to `table_blocks` as the engine's graphs bucket them) and positions [B, width]: context - width ..
    context - 1 (a verify's block)."""
    used = -(-context // page)
    nblk = max(-(-used // 4) * 4, table_blocks)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(hkv, b, width * groups, d, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(b * used + 1, page, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.zeros(b, nblk, dtype=torch.int64, device="cuda")
    tables[:, :used] = 1 + torch.arange(b * used, device="cuda").view(b, used)
    pos = (context - width + torch.arange(width, device="cuda")).repeat(b, 1)
    return q, k, v, tables, pos


def tile(spec: str) -> dict[str, int]:
    """"m64-n32-w4-s2" -> launch's tile arguments; without "w", the engine's warps for each mode (a walking
    program's, or a program per chunk's)."""
    names = {"m": "block_m", "n": "block_n", "w": "num_warps", "s": "num_stages"}
    return {names[p[0]]: int(p[1:]) for p in spec.split("-")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16,32,128")
    ap.add_argument("--chunks", default=str(pa.KEYS_PER_CHUNK), help="keys per chunk (multiples of the tile's keys)")
    ap.add_argument("--context", type=int, default=282)
    ap.add_argument("--width", type=int, default=1, help="tokens a row (16: a DFlash verify's block)")
    ap.add_argument("--tiles", default=f"m{pa.BLOCK_M}-n{pa.BLOCK_N}-s{pa.NUM_STAGES}",
                    help="tile shapes: rows, keys an iteration, warps (optional: the engine's per mode), stages")
    ap.add_argument("--table-blocks", type=int, default=0, help="block table width (0: the context's, rounded up "
                    "to 4 blocks)")
    ap.add_argument("--layouts", default="nhd", help="cache layouts to time: nhd (the engine's [blocks, page, "
                    "heads, d]), hnd ([blocks, heads, page, d] in memory, passed to the kernel as a strided view)")
    ap.add_argument("--distinct", type=int, default=1, help="caches the graph's calls cycle through (36: one a "
                    "layer, as a step reads them; 1: every call reads the same K/V, which L2 may partly hold)")
    ap.add_argument("--out", default="bench/results/paged_split.json")
    a = ap.parse_args()
    rows = []
    scale = 128 ** -0.5
    for b in (int(x) for x in a.batches.split(",")):
        q, k, v, bt, pos = case(b, a.context, a.width, table_blocks=a.table_blocks)
        kv_bytes = 2 * b * a.context * k.shape[2] * k.shape[3] * k.element_size()
        ref = pa.reference(q.float(), k.float(), v.float(), bt, pos, scale)
        configs = [("nhd", "gather", None, None, lambda: pa.reference(q, k, v, bt, pos, scale))]
        for layout in a.layouts.split(","):
            # the same values in another memory order: a layout changes no bit, only where each key's row lies
            kl, vl = (k, v) if layout == "nhd" else (x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
                                                     for x in (k, v))
            # copies of the same values, one a call in turn (--distinct): each call then reads its K/V from memory
            caches = [(kl, vl)] + [(kl.clone(), vl.clone()) for _ in range(a.distinct - 1)]
            for spec in a.tiles.split(","):
                for kpc in (int(x) for x in a.chunks.split(",")):
                    if kpc % tile(spec)["block_n"] == 0:
                        for split in (False, True):
                            turn = itertools.cycle(caches)
                            configs.append((layout, spec, kpc, split, lambda turn=turn, spec=spec, kpc=kpc,
                                            split=split: pa.launch(q, *next(turn), bt, pos, scale, split,
                                                                   keys_per_chunk=kpc, **tile(spec))))
        first: dict = {}
        for layout, spec, kpc, split, fn in configs:
            try:
                us = graph_time(fn, reps=20, inner=36)
                out = fn()
            except Exception as e:  # a tile shape the GPU cannot hold: reported, the sweep goes on
                print(f"b={b:4d} {layout} {spec} kpc={kpc} split={split}: {type(e).__name__}: {str(e)[:120]}",
                      flush=True)
                continue
            err = (out.float() - ref).abs().max().item()
            same = None if split is None else torch.equal(first.setdefault((spec, kpc), out), out)
            same_tiles = None if split is None else torch.equal(first.setdefault(kpc, out), out)
            auto = None if split is None else pa.use_split(
                q.device, -(-q.shape[2] // tile(spec)["block_m"]) * q.shape[0] * b, 0, -(-bt.shape[1] * 16 // kpc))
            rows.append({"batch": b, "width": a.width, "layout": layout, "tiles": spec, "keys_per_chunk": kpc,
                         "split": split, "auto_split": auto,
                         "us_per_call": us, "kv_bytes": kv_bytes, "gb_per_s": kv_bytes / us / 1e3,
                         "max_abs_err_vs_fp32": err, "bitwise_same_across_modes": same,
                         "bitwise_same_as_first_tiles": same_tiles})
            print(f"b={b:4d} t={a.width} {layout} {spec:14s} kpc={kpc} split={split}: {us:7.2f} us a call, "
                  f"{kv_bytes / us / 1e3:7.1f} GB/s, err {err:.2e}, same bits {same} "
                  f"(as the first tiles: {same_tiles})", flush=True)
            write_json(a.out, {"bench": "paged_split", "git": git_revision(), "machine": machine(),
                               "command": command_line("flashpd.bench.paged_split"),
                               "context": a.context, "table_blocks": bt.shape[1], "distinct": a.distinct,
                               "rows": rows})


if __name__ == "__main__":
    main()

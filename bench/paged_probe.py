"""Where a decode's paged attention spends its time: the engine's kernel against probes that do less.

    python -m flashpd.bench.paged_probe --batches 64,128,256 --context 282 --out bench/results/paged_probe.json

The engine's kernel (engine/paged_attention.py) reads about 72% of the copy rate at batch 128, whatever its tile,
chunk size, program count or cache layout (docs/results.md). Each probe here runs the engine kernel's grid (a
program per KV head and sequence, a sequence's heads side by side) over the same cache, block tables and
positions, walks the same keys BLOCK_N at a time, and does less with them:
- "load": reads each key block's page numbers, then its K and V, and adds them up (no dot, no softmax): what
  the gather alone costs;
- "contig": the same bytes with each page number computed rather than read (the table's rows hold consecutive
  pages here): what the dependent table load costs;
- "dots": "load" plus the two MMAs of the engine's 16-row tile (q K^T, then that times V), no mask or softmax;
- "max": "dots" plus the position mask and the running row max (the scores less the max go to the second MMA);
- "exp": "max" plus the exponentials and the accumulator's rescale (no row sum);
- "softmax": the engine's block step (`paged_attention._block`: the whole online softmax) over all of a row's
  keys as one chunk, without the per-chunk states and their merge;
- "engine": the engine's kernel itself (its constants, unsplit, as batch 128 runs it).
Each is timed in a CUDA graph of 36 calls (one per layer) replayed, for each tile (keys an iteration, warps,
stages), and reported as µs a call and the KV bytes' GB/s. The probes' outputs are not attention; only "engine"
is checked (against the fp32 reference).
"""
from __future__ import annotations

import argparse

import torch

from flashpd.bench.attn_micro import graph_time
from flashpd.bench.common import command_line, copy_bandwidth_gbs, git_revision, machine, write_json
from flashpd.bench.paged_split import case
from flashpd.engine import paged_attention as pa

MODES = {"load": 0, "contig": 1, "dots": 2, "max": 3, "exp": 4, "softmax": 5}

if pa.triton is not None:
    import triton
    import triton.language as tl

    from flashpd.engine.paged_attention import _block as engine_block

    @triton.jit
    def _probe_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, out_ptr, HKV, n_keys, sq_h, sq_b, sq_m,
                      sk_blk, sk_off, sk_h, sbt_b, spos_b, qk_scale, G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr,
                      INTERPRET: tl.constexpr):
        """One (KV head, sequence) program walking its keys as the engine's does; MODE picks what it does with
        each block (the module's docstring). Writes a [BM, D] result so that nothing is optimised away."""
        pid = tl.program_id(0)
        b = pid // HKV
        h = pid % HKV
        rows = tl.arange(0, BM)
        dd = tl.arange(0, D)
        pos = tl.load(pos_ptr + b * spos_b)
        hi = tl.minimum(pos + 1, n_keys)
        k_base = k_ptr + h * sk_h + dd[None, :]
        v_base = v_ptr + h * sk_h + dd[None, :]
        acc = tl.zeros([BM, D], tl.float32)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        if MODE >= 2:
            q = tl.load(q_ptr + h * sq_h + b * sq_b + rows[:, None] * sq_m + dd[None, :], mask=(rows < G)[:, None],
                        other=0.0)
        first = tl.load(bt_ptr + b * sbt_b)
        row_pos = tl.where(rows < G, pos, -1)
        for start in range(0, hi, BN):
            if MODE == 5:
                m_i, l_i, acc = engine_block(q, k_base, v_base, bt_ptr + b * sbt_b, row_pos, pos, n_keys, start,
                                             m_i, l_i, acc, qk_scale, sk_blk, sk_off, sk_blk, sk_off, dd < D, PAGE,
                                             BN, False, INTERPRET)
            else:
                keys = start + tl.arange(0, BN)
                k_ok = keys < hi
                if MODE == 1:
                    page = first + keys // PAGE
                else:
                    page = tl.load(bt_ptr + b * sbt_b + keys // PAGE, mask=k_ok, other=0)
                off = keys % PAGE
                k = tl.load(k_base + page[:, None] * sk_blk + off[:, None] * sk_off, mask=k_ok[:, None], other=0.0)
                v = tl.load(v_base + page[:, None] * sk_blk + off[:, None] * sk_off, mask=k_ok[:, None], other=0.0)
                if MODE == 2:
                    s = tl.dot(q, tl.trans(k))
                    acc = tl.dot(s.to(v.dtype), v, acc)
                elif MODE >= 3:
                    s = tl.dot(q, tl.trans(k))
                    s = tl.where(keys[None, :] <= row_pos[:, None], s * qk_scale, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                    if MODE == 3:
                        p = s - m_sub[:, None]
                        acc = tl.dot(p.to(v.dtype), v, acc)
                    else:
                        alpha = tl.exp2(m_i - m_sub)
                        p = tl.exp2(s - m_sub[:, None])
                        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
                    m_i = m_new
                else:
                    acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)[None, :]
        if MODE == 5:
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        elif MODE >= 3:
            acc += m_i[:, None]
        tl.store(out_ptr + pid * BM * D + rows[:, None] * D + dd[None, :], acc)


def probe(mode: str, q, k, v, bt, pos, block_n: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """One probe call over a decode's q [Hkv, B, G, d] and the engine's cache layout [blocks, page, Hkv, d]."""
    hkv, b, g, d = q.shape
    out = torch.empty((hkv * b, 16, d), dtype=torch.float32, device=q.device)
    _probe_kernel[(hkv * b,)](q, k, v, bt, pos, out, hkv, bt.shape[1] * k.shape[1], q.stride(0), q.stride(1),
                              q.stride(2), k.stride(0), k.stride(1), k.stride(2), bt.stride(0), pos.stride(0),
                              128 ** -0.5 * pa.LOG2E, G=g, PAGE=k.shape[1], D=d, BM=16, BN=block_n, MODE=MODES[mode], INTERPRET=pa.INTERPRET,
                              num_warps=num_warps, num_stages=num_stages)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--context", type=int, default=282)
    ap.add_argument("--modes", default="engine,load,contig,dots,max,exp,softmax")
    ap.add_argument("--tiles", default="n64-w4-s3,n64-w4-s2,n64-w8-s3,n128-w4-s3,n128-w8-s3,n32-w4-s4,n64-w4-s4",
                    help="the probes' tiles: keys an iteration, warps, stages (the engine's own tile is n64-w4-s3)")
    ap.add_argument("--table-blocks", type=int, default=32, help="block table width, as the engine's graphs "
                    "bucket it")
    ap.add_argument("--out", default="bench/results/paged_probe.json")
    a = ap.parse_args()
    copy = copy_bandwidth_gbs()
    print(f"copy rate {copy['gb_per_s']:.0f} GB/s", flush=True)
    rows = []
    scale = 128 ** -0.5
    for b in (int(x) for x in a.batches.split(",")):
        q, k, v, bt, pos = case(b, a.context, 1, table_blocks=a.table_blocks)
        kv_bytes = 2 * b * a.context * k.shape[2] * k.shape[3] * k.element_size()
        for mode in a.modes.split(","):
            specs = ["engine"] if mode == "engine" else a.tiles.split(",")
            for spec in specs:
                args = (q, k, v, bt, pos)
                if mode == "engine":
                    def fn(args=args):
                        return pa.launch(*args, scale, False)
                else:
                    n, w, s = (int(p[1:]) for p in spec.split("-"))

                    def fn(args=args, n=n, w=w, s=s, mode=mode):
                        return probe(mode, *args, n, w, s)
                try:
                    us = graph_time(fn, reps=20, inner=36)
                except Exception as e:  # noqa: BLE001 (a tile the GPU cannot hold: reported, the sweep goes on)
                    print(f"b={b} {mode} {spec}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                row = {"batch": b, "mode": mode, "tile": spec, "us_per_call": us, "kv_bytes": kv_bytes,
                       "gb_per_s": kv_bytes / us / 1e3, "of_copy_rate": kv_bytes / us / 1e3 / copy["gb_per_s"]}
                if mode == "engine":
                    ref = pa.reference(q.float(), k.float(), v.float(), bt, pos, scale)
                    row["max_abs_err_vs_fp32"] = (fn().float() - ref).abs().max().item()
                rows.append(row)
                print(f"b={b:4d} {mode:7s} {spec:11s} {us:7.2f} us  {row['gb_per_s']:7.1f} GB/s  "
                      f"{row['of_copy_rate']:.3f} of copy", flush=True)
                write_json(a.out, {"bench": "paged_probe", "git": git_revision(), "machine": machine(),
                                   "command": command_line("flashpd.bench.paged_probe"), "copy_bandwidth": copy,
                                   "context": a.context, "table_blocks": a.table_blocks, "rows": rows})


if __name__ == "__main__":
    main()

"""Batch 32-256 projections at the Qwen3-8B shape: cuBLASLt / cuBLAS against a Triton GEMM sweep (split-K too).

Each (shape, M): 8 distinct weight copies cycled in a CUDA graph of 32 calls (the L2 never holds the next weight),
us a call, TB/s of weight read, and the best Triton configs' bits against torch's fp32 reference error.
Usage: python gemm_mid.py out.json [cpu]
"""
import itertools
import json
import sys
import time

import torch
import triton
import triton.language as tl

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
MS = [32, 64, 128, 256]
COPIES = 8


@triton.jit
def _mm(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, GROUP_N: tl.constexpr):
    """out[s, m, n] (fp32 partials when SPLIT > 1, else x.dtype) = x[m, kr] . w[n, kr] over split s's K range."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    n_m = tl.cdiv(M, BM)
    # m fastest: the programs sharing a weight tile run together (the weight is read once from HBM)
    pid_m = pid % n_m
    pid_n = pid // n_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k0 = s * K_SPLIT
    xp = x_ptr + rm[:, None] * K + (k0 + rk)[None, :]
    wp = w_ptr + rn[:, None] * K + (k0 + rk)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K_SPLIT, BK):
        a = tl.load(xp, mask=rm[:, None] < M, other=0.0)
        b = tl.load(wp)
        acc = tl.dot(a, tl.trans(b), acc)
        xp += BK
        wp += BK
    op = out_ptr + s * M * N + rm[:, None] * N + rn[None, :]
    if SPLIT == 1:
        tl.store(op, acc.to(out_ptr.dtype.element_ty), mask=rm[:, None] < M)
    else:
        tl.store(op, acc, mask=rm[:, None] < M)


@triton.jit
def _sum(p_ptr, out_ptr, MN, SPLIT: tl.constexpr, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < MN
    acc = tl.load(p_ptr + i, mask=m, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + i, mask=m, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=m)


def tri(x, w, cfg, part, out):
    bm, bn, bk, split, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    ks = k // split
    grid = (triton.cdiv(m, bm) * (n // bn), split)
    if split == 1:
        _mm[grid](x, w, out, m, n, k, ks, BM=bm, BN=bn, BK=bk, SPLIT=1, GROUP_N=1, num_warps=warps,
                  num_stages=stages)
    else:
        _mm[grid](x, w, part, m, n, k, ks, BM=bm, BN=bn, BK=bk, SPLIT=split, GROUP_N=1, num_warps=warps,
                  num_stages=stages)
        _sum[(triton.cdiv(m * n, 1024),)](part, out, m * n, SPLIT=split, B=1024, num_warps=4)
    return out


def time_graph(fn, reps=5):
    """us a call: 32 calls in a graph, median of reps replays."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(32):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / 32)
    return sorted(ts)[len(ts) // 2]


def configs(m):
    out = []
    for bm, bn, bk, split, warps, stages in itertools.product(
            [64, 128], [32, 64, 128], [64, 128], [1, 2, 4], [4, 8], [3, 4]):
        if bm > max(64, m) or (bm == 128 and bn == 128 and bk == 128 and stages > 3):
            continue
        if (warps == 8) != (bm * bn >= 128 * 128):
            continue
        out.append((bm, bn, bk, split, warps, stages))
    return out


def main():
    outp = sys.argv[1]
    cpu = len(sys.argv) > 2
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
           "triton": triton.__version__, "copies": COPIES, "results": []}
    shapes = {"o": (256, 512)} if cpu else SHAPES
    ms = [32] if cpu else MS
    t_start = time.time()
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            ref = (x.float() @ ws[0].float().T)
            row = {"shape": name, "n": n, "k": k, "m": m, "weight_mb": n * k * 2 / 1e6}
            outs = [torch.empty(m, n, device=DEV, dtype=torch.bfloat16) for _ in range(COPIES)]
            for lib in ("cublaslt", "cublas"):
                torch.backends.cuda.preferred_blas_library(lib)
                us = time_graph(lambda i: torch.mm(x, ws[i % COPIES].T, out=outs[i % COPIES]))
                row[lib + "_us"] = us
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["lt_err"] = (torch.mm(x, ws[0].T).float() - ref).abs().max().item()
            best = []
            for cfg in configs(m):
                split = cfg[3]
                if k % (split * cfg[2]):
                    continue
                part = torch.empty(split, m, n, device=DEV, dtype=torch.float32) if split > 1 else None
                try:
                    us = time_graph(lambda i: tri(x, ws[i % COPIES], cfg, part, outs[i % COPIES]), reps=3)
                except Exception as e:  # out of resources etc.
                    continue
                best.append((us, cfg))
            best.sort()
            top = []
            for us, cfg in best[:4]:
                split = cfg[3]
                part = torch.empty(split, m, n, device=DEV, dtype=torch.float32) if split > 1 else None
                us2 = time_graph(lambda i: tri(x, ws[i % COPIES], cfg, part, outs[i % COPIES]), reps=7)
                o = tri(x, ws[0], cfg, part, torch.empty(m, n, device=DEV, dtype=torch.bfloat16))
                top.append({"cfg": dict(zip(("bm", "bn", "bk", "split", "warps", "stages"), cfg)), "us": us2,
                            "err": (o.float() - ref).abs().max().item()})
            row["triton_top"] = top
            row["n_configs"] = len(best)
            lt = row["cublaslt_us"]
            bt = top[0]["us"] if top else float("nan")
            print(f"{name:8s} m={m:4d} {row['weight_mb']:.0f} MB: lt {lt:.2f} us ({n*k*2/lt/1e6:.2f} TB/s) "
                  f"cublas {row['cublas_us']:.2f} triton {bt:.2f} {top[0]['cfg'] if top else ''} "
                  f"[{time.time()-t_start:.0f}s]", flush=True)
            res["results"].append(row)
        del ws
        torch.cuda.empty_cache() if DEV == "cuda" else None
    json.dump(res, open(outp, "w"), indent=1)


if __name__ == "__main__":
    main()

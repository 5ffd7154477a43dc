"""The few-row GEMM with its weight (and x) tiles loaded by TMA (host tensor descriptors) against the engine's
pointer loads (skinny_gemm.launch), at the Qwen3-8B shapes, 1 and 16 rows.

Each (shape, M, variant): COPIES distinct weights cycled in a CUDA graph of 32 calls (the L2 never holds the next
weight), us a call (median of trials) and TB/s; bits against the engine kernel at its tile.
Usage: python tma.py out.json
"""
import json
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashpd.engine import skinny_gemm, triton_env
from flashpd.engine.triton_env import pdl_release, pdl_wait

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "head": (151936, 4096)}
MS = [1, 16]


@triton.jit
def _tma_kernel(x_ptr, x_desc, w_desc, y_ptr, M, N, K, sxm, sym, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, X_TMA: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    n0 = pid * BN
    rm = tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    pdl_wait(PDL)
    acc = tl.zeros([BM, BN], tl.float32)
    x_base = x_ptr + rm[:, None] * sxm + rk[None, :]
    for k in range(0, K, BK):
        if X_TMA:
            a = x_desc.load([0, k])
        else:
            a = tl.load(x_base + k, mask=(rm < M)[:, None], other=0.0)
        w = w_desc.load([n0, k])
        acc = tl.dot(a, tl.trans(w), acc)
    pdl_release(PDL)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


def tma_launch(x, w, bn, bk, warps, stages, x_tma, wd=None, xd=None):
    m, k = x.shape
    n = w.shape[0]
    y = x.new_empty((m, n))
    wd = wd or TensorDescriptor.from_tensor(w, [bn, bk])
    xd = xd or TensorDescriptor.from_tensor(x, [16, bk])
    _tma_kernel[(triton.cdiv(n, bn),)](x, xd, wd, y, m, n, k, x.stride(0), y.stride(0), BM=16, BN=bn, BK=bk,
                                       X_TMA=x_tma, num_warps=warps, num_stages=stages,
                                       **triton_env.pdl_args(x.device))
    return y


def timed(fn_list, trials=7, reps=10):
    """fn_list: callables (one per call in the graph). -> median us a call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fn_list[:4]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fn_list:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1000 / reps / len(fn_list))
    return statistics.median(out)


def main():
    torch.manual_seed(0)
    dev = "cuda"
    res = {"triton": triton.__version__, "pdl": triton_env.pdl(torch.device(dev)), "rows": []}
    for name, (n, k) in SHAPES.items():
        copies = 4 if name == "head" else 8
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        base_tile = skinny_gemm.tile(n, k)
        variants = [("base", base_tile, None)]
        for t in [base_tile, (16, 128, 2, 4), (16, 128, 2, 8), (16, 128, 4, 6), (32, 128, 2, 6), (32, 128, 4, 4),
                  (32, 128, 4, 6), (64, 128, 4, 4), (16, 256, 2, 4), (32, 64, 2, 8)]:
            for x_tma in (False, True):
                variants.append((f"tma_w{'x' if x_tma else ''}", t, x_tma))
        for m in MS:
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            ref = skinny_gemm.launch(xs[0], ws[0], *base_tile)
            for vname, t, x_tma in variants:
                try:
                    if x_tma is None:
                        calls = [(lambda i=i: skinny_gemm.launch(xs[i % copies], ws[i % copies], *t))
                                 for i in range(32)]
                        y0 = skinny_gemm.launch(xs[0], ws[0], *t)
                    else:
                        wds = [TensorDescriptor.from_tensor(w, [t[0], t[1]]) for w in ws]
                        xds = [TensorDescriptor.from_tensor(x, [16, t[1]]) for x in xs]
                        calls = [(lambda i=i: tma_launch(xs[i % copies], ws[i % copies], *t, x_tma,
                                                         wds[i % copies], xds[i % copies])) for i in range(32)]
                        y0 = tma_launch(xs[0], ws[0], *t, x_tma)
                    us = timed(calls)
                    row = {"shape": name, "m": m, "variant": vname, "tile": list(t), "us": round(us, 2),
                           "tb_s": round(n * k * 2 / us / 1e6, 3), "equal_base": bool(torch.equal(y0, ref))}
                except Exception as e:  # a tile TMA or the compiler refuses
                    row = {"shape": name, "m": m, "variant": vname, "tile": list(t), "error": repr(e)[:300]}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()

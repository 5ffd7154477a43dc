"""Diagnosis, not run yet: programmatic dependent launch (PDL) where each few-row GEMM prefetches its own weight slice
into L2 *before* it waits for the kernel ahead of it, on a batch-1 layer's chain of kernels.

At batch 1 the few-row kernel reads its weights at about 87% of the copy rate over a step (4.14 ms for ~15.2 GB),
and between o_proj and the next layer's q/k/v three latency-bound kernels (qkv_rope, attention, combine, ~3-4 µs
each) leave the memory idle. 54d9aa3's PDL waited at the top of every kernel, so nothing could overlap (+14% at
batch 1). Here a GEMM's programs, launched early by the kernel ahead (which calls launch_dependents at its top),
issue L2 prefetches of their rows first and only then wait; the loop then reads from L2 what arrived. The latency
kernels are one-program spins (~3.5 µs). 24 layers of distinct weights a CUDA graph, one row of x.

Modes: 0 plain launches; 1 PDL, wait at the top (54d9aa3's form); 2 PDL, a prefetch instruction a 128-byte line of
the program's rows, then wait; 3 PDL, one bulk prefetch (cp.async.bulk.prefetch.L2) a row, then wait. The K loop
is the engine's plain one; the outputs' bits are compared across modes.

    OUT=. python pdl_prefetch.py        # on an H200: pdl_prefetch.json (µs a layer by mode)
"""
import json
import os

import torch
import triton
import triton.language as tl

from flashpd.bench.gemm_shapes import graph_us
from flashpd.engine import skinny_gemm as sg


@triton.jit
def _wait(MODE: tl.constexpr):
    if MODE >= 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _gemm(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          MODE: tl.constexpr, LINES_PER_ROW: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BM)
    rn = pid * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    if MODE == 2:  # one prefetch a 128-byte line of this program's BN rows
        li = tl.arange(0, BN * LINES_PER_ROW)
        p = w_ptr + (pid * BN + li // LINES_PER_ROW) * swn + (li % LINES_PER_ROW) * 64
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [p],
                                  dtype=tl.int32, is_pure=False, pack=1)
    if MODE == 3:  # one bulk prefetch a row (K * 2 bytes, a multiple of 16)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                  [w_ptr + rn * swn, tl.zeros([BN], tl.int32) + K * 2], dtype=tl.int32,
                                  is_pure=False, pack=1)
    _wait(MODE)
    m_ok = rm < M
    x_base = x_ptr + rm[:, None] * sxm + rk[None, :]
    w_base = w_ptr + rn[:, None] * swn + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_base + k, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_base + k)
        acc = tl.dot(a, tl.trans(w), acc)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _spin(x_ptr, n_iter, MODE: tl.constexpr):
    _wait(MODE)
    x = tl.load(x_ptr + tl.arange(0, 32))
    for i in range(n_iter):
        x = x * 1.0001 + 0.5
    tl.store(x_ptr + tl.arange(0, 32), x)


def gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, mode: int) -> None:
    n, k = w.shape
    bn, bk, warps, stages = sg.tile(n, k)
    _gemm[(n // bn,)](x, w, y, x.shape[0], n, k, x.stride(0), w.stride(0), y.stride(0), BM=16, BN=bn, BK=bk,
                      MODE=mode, LINES_PER_ROW=k * 2 // 128, num_warps=warps, num_stages=stages,
                      launch_pdl=mode >= 1)


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
    layers = [{name: torch.randn(n, k, device=dev, dtype=dt) * 0.02 for name, (n, k) in shapes.items()}
              for _ in range(24)]
    x = {name: torch.randn(1, k, device=dev, dtype=dt) for name, (n, k) in shapes.items()}
    ys = {mode: {name: torch.empty(1, n, device=dev, dtype=dt) for name, (n, k) in shapes.items()} for mode in range(4)}
    buf = torch.zeros(64, device=dev)
    res = {}
    for spin_iters in (850, 0):
        for mode in range(4):
            def layer(l, mode=mode):
                calls = [lambda: gemm(x["qkv"], l["qkv"], ys[mode]["qkv"], mode)]
                calls += [lambda: _spin[(1,)](buf, spin_iters, MODE=mode, launch_pdl=mode >= 1)] * 3
                calls += [lambda n=name: gemm(x[n], l[n], ys[mode][n], mode) for n in ("o_proj", "gate_up", "down")]
                return calls
            calls = [c for l in layers for c in layer(l)]
            res[f"spin{spin_iters}_mode{mode}_us_a_layer"] = graph_us(calls) * len(calls) / len(layers)
            print(f"spin {spin_iters} mode {mode}: {res[f'spin{spin_iters}_mode{mode}_us_a_layer']:.2f} µs a layer",
                  flush=True)
    for name in shapes:  # the last layer's outputs, by mode
        res[f"{name}_bits_equal"] = all(torch.equal(ys[0][name], ys[m][name]) for m in range(1, 4))
    res["alone_us"] = {name: graph_us([lambda l=l, n=name: gemm(x[n], l[n], ys[0][n], 0) for l in layers])
                       for name in shapes}
    print(res, flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "pdl_prefetch.json"), "w"), indent=1)


if __name__ == "__main__":
    main()

"""Diagnosis: programmatic dependent launch (PDL) on a batch-1 layer's kernel chain, with the trigger placed late
(a GEMM lets the next kernel launch after its K loop, not at its top) and a bounded L2 prefetch before the wait.

The first diagnosis (pdl_prefetch.py's modes 1-3; the engine patch) triggered at the top of every kernel: the next
kernel's programs then sit on the SMs for the whole of this kernel, and a prefetch of whole weight rows (gate/up's
200 MB, far past the 50 MB L2) streams every weight twice. Here:
  0 plain launches;
  1 PDL, wait then trigger at the top of every kernel (54d9aa3's form);
  3 as 1, a bulk prefetch of each program's whole rows before the wait;
  4 PDL, a GEMM waits at its top and triggers after its K loop; the latency kernels trigger then wait;
  5 as 4, a GEMM prefetches (bulk, a row) o_proj's whole rows and the first eighth of the others' before it waits;
  6 as 4, only o_proj prefetches (whole rows; 32 MB, it fits L2);
  7 as 4, every GEMM prefetches its whole rows.
The latency kernels are one-program spins (~3.5 µs; 0 iterations: launch cost only). 24 layers of distinct weights a
CUDA graph, one row of x. Outputs' bits are compared across modes.

    OUT=. python pdl_late.py        # on an H200: pdl_late.json (µs a layer by mode)
"""
import json
import os

import torch
import triton
import triton.language as tl

from flashpd.bench.gemm_shapes import graph_us
from flashpd.engine import skinny_gemm as sg

MODES = (0, 1, 3, 4, 5, 6, 7)


@triton.jit
def _gemm(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym, PF_BYTES, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, PDL: tl.constexpr, TOP: tl.constexpr, PF: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BM)
    rn = pid * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    if PF:  # one bulk prefetch a row, PF_BYTES (a multiple of 16) from the row's start
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                  [w_ptr + rn * swn, tl.zeros([BN], tl.int32) + PF_BYTES], dtype=tl.int32,
                                  is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
        if TOP:
            tl.extra.cuda.gdc_launch_dependents()
    m_ok = rm < M
    x_base = x_ptr + rm[:, None] * sxm + rk[None, :]
    w_base = w_ptr + rn[:, None] * swn + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_base + k, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_base + k)
        acc = tl.dot(a, tl.trans(w), acc)
    if PDL:
        if not TOP:
            tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _spin(x_ptr, n_iter, PDL: tl.constexpr, TOP: tl.constexpr):
    if PDL:
        if TOP:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        else:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + tl.arange(0, 32))
    for i in range(n_iter):
        x = x * 1.0001 + 0.5
    tl.store(x_ptr + tl.arange(0, 32), x)


def pf_bytes(name: str, k: int, mode: int) -> int:
    """The bytes a row prefetches under `mode` (0: none)."""
    whole = k * 2
    if mode in (3, 7):
        return whole
    if mode == 5:
        return whole if name == "o_proj" else whole // 8
    if mode == 6:
        return whole if name == "o_proj" else 0
    return 0


def gemm(name: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, mode: int) -> None:
    n, k = w.shape
    bn, bk, warps, stages = sg.tile(n, k)
    pf = pf_bytes(name, k, mode)
    _gemm[(n // bn,)](x, w, y, x.shape[0], n, k, x.stride(0), w.stride(0), y.stride(0), pf, BM=16, BN=bn, BK=bk,
                      PDL=mode >= 1, TOP=mode < 4, PF=pf > 0, num_warps=warps, num_stages=stages,
                      launch_pdl=mode >= 1)


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
    layers = [{nm: torch.randn(n, k, device=dev, dtype=dt) * 0.02 for nm, (n, k) in shapes.items()}
              for _ in range(24)]
    x = {nm: torch.randn(1, k, device=dev, dtype=dt) for nm, (n, k) in shapes.items()}
    ys = {mode: {nm: torch.empty(1, n, device=dev, dtype=dt) for nm, (n, k) in shapes.items()} for mode in MODES}
    buf = torch.zeros(64, device=dev)
    res = {}
    for spin_iters in (850, 0):
        for mode in MODES:
            def layer(l: dict, mode: int = mode) -> list:
                calls = [lambda: gemm("qkv", x["qkv"], l["qkv"], ys[mode]["qkv"], mode)]
                calls += [lambda: _spin[(1,)](buf, spin_iters, PDL=mode >= 1, TOP=mode < 4, launch_pdl=mode >= 1)] * 3
                calls += [lambda nm=nm: gemm(nm, x[nm], l[nm], ys[mode][nm], mode) for nm in ("o_proj", "gate_up", "down")]
                return calls
            key = f"spin{spin_iters}_mode{mode}_us_a_layer"
            try:
                calls = [c for l in layers for c in layer(l)]
                res[key] = graph_us(calls) * len(calls) / len(layers)
                print(f"spin {spin_iters} mode {mode}: {res[key]:.2f} µs a layer", flush=True)
            except Exception as e:  # a mode that fails to compile or run: say so, go on
                res[key] = f"error: {type(e).__name__}: {e}"[:300]
                print(key, res[key], flush=True)
    for nm in shapes:  # the last layer's outputs, by mode
        res[f"{nm}_bits_equal"] = all(torch.equal(ys[0][nm], ys[m][nm]) for m in MODES[1:])
    res["alone_us"] = {nm: graph_us([lambda l=l, nm=nm: gemm(nm, x[nm], l[nm], ys[0][nm], 0) for l in layers])
                       for nm in shapes}
    print(res, flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "pdl_late.json"), "w"), indent=1)


if __name__ == "__main__":
    main()

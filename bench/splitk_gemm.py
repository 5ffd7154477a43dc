"""A split-K Triton GEMM for a decode batch's rows, then a fixed-order reduction: bench/gemm_shapes.py's
"splitk" variant, measured against cuBLAS and not taken by the engine (docs/results.md: slower at every tile
it was swept at).

The idea it tests: at 128 rows cuBLAS reads the smaller weights of a layer at 56-72% of the copy rate (o_proj,
q/k/v, down), where gate/up reaches 88%. o_proj's 32 MB over cuBLAS's 128 tiles of 64x64 is one wave of 128
programs, each streaming 512 KB alone. Here each program holds every row of x (BLOCK_M = 64 or 128) and BLOCK_N
rows of w, and walks one of SPLITS slices of K, so W is read once and the grid is 1-2 programs an SM whatever N
is. Each slice's fp32 partial goes to a workspace; a second kernel adds the slices in slice order and rounds
once, so the result is deterministic and a row's bits do not depend on the other rows.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# triton, the interpreter switch and the int32 offset bound as the engine's projection kernel has them
from flashpd.engine.skinny_gemm import INTERPRET, MAX_WEIGHT_ELEMENTS, triton

if triton is not None:
    import triton.language as tl

REDUCE_BLOCK = 1024


class Tile(NamedTuple):
    """block_m (rows a program holds; a call of more rows takes several), block_n, block_k, splits of K, warps,
    pipeline stages."""
    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int

    @classmethod
    def parse(cls, s: str) -> Tile:
        """"128-128-64-4-8-4" -> Tile(128, 128, 64, 4, 8, 4)."""
        parts = [int(p) for p in s.split("-")]
        if len(parts) != 6:
            raise ValueError(f"a tile is six numbers BM-BN-BK-SPLITS-WARPS-STAGES, not {s!r}")
        return cls(*parts)


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _splitk_kernel(x_ptr, w_ptr, p_ptr, M, N, K, sxm, swn, KSTEPS, SPLITS,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                       ROWWISE: tl.constexpr):
        """One program: the fp32 partial of rows [m0, m0+BM) and columns [n0, n0+BN) over its slice of K, to
        p[slice, row, column]. Slice s takes K steps [s*KSTEPS//SPLITS, (s+1)*KSTEPS//SPLITS). Axis 0 is the
        row tile, so the programs that read one tile of w run side by side and share it through L2."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        s = tl.program_id(2)
        k_lo = (s * KSTEPS // SPLITS) * BK
        k_hi = ((s + 1) * KSTEPS // SPLITS) * BK
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        x_base = x_ptr + rm[:, None] * sxm + rk[None, :]
        w_base = w_ptr + rn[:, None] * swn + rk[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        for k in range(k_lo, k_hi, BK):
            a = tl.load(x_base + k, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_base + k, mask=n_ok[:, None], other=0.0)
            if ROWWISE:
                acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
            elif F32:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        p = p_ptr + s * M * N + rm[:, None] * N + rn[None, :]
        tl.store(p, acc, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _reduce_kernel(p_ptr, y_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """y = the sum of the SPLITS partials, added in slice order, rounded once to y's dtype."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < MN
        acc = tl.load(p_ptr + i, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(p_ptr + s * MN + i, mask=ok, other=0.0)
        tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def launch(x: torch.Tensor, w: torch.Tensor, t: Tile) -> torch.Tensor:
    """x [M, K] (rows contiguous), w [N, K] (rows contiguous), K a multiple of t.block_k -> x @ w.T [M, N] in
    x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    if k % t.block_k or t.splits < 1 or t.splits > k // t.block_k:
        raise ValueError(f"tile {t} does not split K = {k}")
    if w.numel() > MAX_WEIGHT_ELEMENTS or t.splits * m * n > MAX_WEIGHT_ELEMENTS:
        raise ValueError(f"a weight of {w.numel()} elements or {t.splits}x{m}x{n} partials is past int32 offsets")
    part = torch.empty((t.splits, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), t.splits)
    _splitk_kernel[grid](x, w, part, m, n, k, x.stride(0), w.stride(0), k // t.block_k, t.splits,
                         BM=t.block_m, BN=t.block_n, BK=t.block_k, F32=x.dtype == torch.float32,
                         ROWWISE=INTERPRET, num_warps=t.num_warps, num_stages=t.num_stages)
    y = x.new_empty((m, n))
    _reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](part, y, m * n, SPLITS=t.splits, BLOCK=REDUCE_BLOCK,
                                                        num_warps=4)
    return y

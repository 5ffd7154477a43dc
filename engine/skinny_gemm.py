"""y = x @ w.T for a few rows of x (decode, a DFlash verify's or draft's block): a Triton kernel that reads w once.

At batch 1 and at a verify's 16 rows a projection is a pass over its weight; cuBLAS's kernels for q/k/v, o_proj
and down at these shapes run at 73-85% of the copy rate on an H200 (docs/results.md), and pick a different
kernel for each row count, so a row's bits depend on how many rows share the call.

Each program here holds all of x's rows (up to BLOCK_M = 16: one MMA tile) and BLOCK_N of w's rows, and walks K
in BLOCK_K steps with tl.dot in fp32. One tile shape serves every row count up to 16, and an MMA computes each
output row from that row alone, in the same order wherever it sits in the tile: a row's bits do not depend on
how many rows share the call (`batch_invariant` checks it on a GPU).
"""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

triton = None
if torch.backends.cuda.is_built() or INTERPRET:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        triton = None

BLOCK_M = 16  # the most rows a call takes: the smallest tile tl.dot takes
MAX_ROWS = BLOCK_M
BLOCK_N = 16
BLOCK_K = 256
NUM_WARPS = 4
NUM_STAGES = 4


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
        """One program: y[:M, n0:n0+BN] over all of K."""
        pid = tl.program_id(0)
        rm = tl.arange(0, BM)
        rn = pid * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        x_base = x_ptr + rm[:, None] * sxm + rk[None, :]
        w_base = w_ptr + rn[:, None] * swn + rk[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        for k in range(0, K, BK):
            if EVEN_K:
                a = tl.load(x_base + k, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_base + k, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = (k + rk) < K
                a = tl.load(x_base + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_base + k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, swn, BN: tl.constexpr, BK: tl.constexpr):
        """One row, FMA instead of MMA (a bench variant: the bandwidth a plain GEMV reaches)."""
        pid = tl.program_id(0)
        rn = pid * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        n_ok = rn < N
        acc = tl.zeros([BN, BK], tl.float32)
        for k in range(0, K, BK):
            a = tl.load(x_ptr + k + rk)
            w = tl.load(w_ptr + rn[:, None] * swn + (k + rk)[None, :], mask=n_ok[:, None], other=0.0)
            acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        tl.store(y_ptr + rn, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=n_ok)


def launch(x: torch.Tensor, w: torch.Tensor, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
           num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [M <= 16, K] (rows contiguous), w [N, K] -> x @ w.T [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= BLOCK_M and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    y = x.new_empty((m, n)) if out is None else out
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BM=BLOCK_M, BN=block_n, BK=block_k, EVEN_K=k % block_k == 0, num_warps=num_warps, num_stages=num_stages)
    return y


def launch_gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 8, block_k: int = 512, num_warps: int = 4,
                num_stages: int = 4) -> torch.Tensor:
    """x [1, K] -> x @ w.T [1, N] with the FMA kernel (K a multiple of block_k)."""
    n, k = w.shape
    assert x.shape == (1, k) and k % block_k == 0
    y = x.new_empty((1, n))
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, y, n, k, w.stride(0), BN=block_n, BK=block_k,
                                             num_warps=num_warps, num_stages=num_stages)
    return y

"""y = x @ w.T for up to 16 rows of x (a decode at batch 1, a DFlash verify's or draft's block): one Triton kernel.

At these row counts a projection is a pass over its weight. cuBLAS reads the smaller weights of a layer well
below the copy rate at one row, adds a split-K reduction kernel to some, and picks another kernel for each row
count, so a row's bits depend on how many rows share the call (bench/gemm_shapes.py; docs/results.md).

Each program holds every row of x (up to BLOCK_M = 16, the smallest tile tl.dot takes) and BLOCK_N rows of w, and
walks K in BLOCK_K steps with tl.dot, accumulating in fp32. The tile depends on w's shape only (`tile`), never on
the row count, and an MMA computes each output row from that row alone, in the same order wherever it sits in the
tile: a row's bits are the same alone and among 16 (tests/test_skinny_gemm.py, on a GPU).

`linear` is the engine's projection: this kernel where it applies (`applies`: CUDA, bf16 or fp16, at most 16 rows,
a weight within int32 offsets), F.linear elsewhere (the CPU, fp32, batches, prefill).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashpd.engine.triton_env import INTERPRET, tl, triton  # triton None: F.linear only

BLOCK_M = 16  # the most rows a call takes
MAX_ROWS = BLOCK_M
MAX_WEIGHT_ELEMENTS = 2 ** 31 - 1  # the kernel indexes the weight in int32
# (BLOCK_N, BLOCK_K, warps, stages) by w's rows: picked by bench/gemm_shapes.py's sweep at the Qwen3-8B shape
# (docs/results.md): 16 output columns a program for q/k/v, o_proj and down (N <= 8192, 256-384 programs);
# 32 for gate/up and the LM head
TILE_NARROW = (16, 128, 2, 6)
TILE_WIDE = (32, 128, 2, 6)
WIDE_N = 8192


def available() -> bool:
    return triton is not None


def tile(n: int, k: int) -> tuple[int, int, int, int]:
    """The tile for a weight of n rows and k columns: a function of the weight alone, so of no row count."""
    return TILE_WIDE if n > WIDE_N else TILE_NARROW


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                       F32: tl.constexpr, ROWWISE: tl.constexpr):
        """One program: y[:M, n0:n0+BN] over all of K. F32: fp32 inputs, multiplied in fp32 (no tf32). ROWWISE
        (the interpreter only): a broadcast product summed along K, as paged_attention._dot explains."""
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
            if ROWWISE:
                acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
            elif F32:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def launch(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_warps: int, num_stages: int
           ) -> torch.Tensor:
    """x [M <= 16, K] (rows contiguous), w [N, K] (rows contiguous) -> x @ w.T [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= BLOCK_M and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    if w.numel() > MAX_WEIGHT_ELEMENTS:
        raise ValueError(f"a weight of {w.numel()} elements is past the kernel's int32 indexing")
    y = x.new_empty((m, n))
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BM=BLOCK_M, BN=block_n, BK=block_k,
        EVEN_K=k % block_k == 0, F32=x.dtype == torch.float32, ROWWISE=INTERPRET,
        num_warps=num_warps, num_stages=num_stages)
    return y


if triton is not None:
    # an opaque custom op, as paged_attention's: compiled, inductor calls it as one extern kernel
    @torch.library.custom_op("flashpd::skinny_linear", mutates_args=())
    def _skinny_linear_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return launch(x, w, *tile(w.shape[0], w.shape[1]))

    @_skinny_linear_op.register_fake
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))


def applies(device: torch.device, dtype: torch.dtype, rows: int, weight_numel: int) -> bool:
    """Whether `linear` takes the kernel: on CUDA with triton, in bf16 or fp16 (fp32 keeps cuBLAS's exact
    fp32; the oracles compare there), at most MAX_ROWS rows, and a weight whose offsets fit the kernel's 32-bit
    index arithmetic (MAX_WEIGHT_ELEMENTS)."""
    return (triton is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and rows <= MAX_ROWS and weight_numel <= MAX_WEIGHT_ELEMENTS)


def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel on x [..., K] of any leading shape (at most 16 rows in all) -> [..., N]; on any device triton
    runs on (the interpreter in tests), fp32 included."""
    if triton is None:
        raise RuntimeError("skinny_linear needs triton")
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    return torch.ops.flashpd.skinny_linear(x2, w.contiguous()).view(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) without bias: the kernel where `applies`, else F.linear."""
    if applies(x.device, x.dtype, x.numel() // x.shape[-1], w.numel()) and w.dtype == x.dtype:
        return skinny_linear(x, w)
    return F.linear(x, w)

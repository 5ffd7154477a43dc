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
FUSED_ENABLED = True  # `fused_applies`' switch (the engine's fused decode layers; off: the unfused steps)


def available() -> bool:
    return triton is not None


def tile(n: int, k: int) -> tuple[int, int, int, int]:
    """The tile for a weight of n rows and k columns: a function of the weight alone, so of no row count."""
    return TILE_WIDE if n > WIDE_N else TILE_NARROW


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, g_ptr, r_ptr, M, N, K, sxm, swn, sym, srm, eps,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                       F32: tl.constexpr, ROWWISE: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr,
                       RESID: tl.constexpr):
        """One program: y[:M, n0:n0+BN] over all of K. F32: fp32 inputs, multiplied in fp32 (no tf32). ROWWISE
        (the interpreter only): a broadcast product summed along K, as paged_attention._dot explains.
        The fused forms (`fused_linear`): NORM, x is the residual stream and g its RMS norm's weight: the K loop
        multiplies x by g and sums x's squares, and the row's 1/rms scales the accumulator at the end. SWIGLU, x
        is [gate | up] (K columns each): the input is silu(gate) * up. RESID: y = round(x @ w.T) + r."""
        pid = tl.program_id(0)
        rm = tl.arange(0, BM)
        rn = pid * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        x_base = x_ptr + rm[:, None] * sxm + rk[None, :]
        w_base = w_ptr + rn[:, None] * swn + rk[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        ss = tl.zeros([BM, BK], tl.float32)  # NORM: x's squares, summed over K after the loop
        # NORM and SWIGLU change x's tile before the MMA, and a load whose value is computed on is not one the
        # compiler pipelines (each K step waited for its x tile: 3.6x the plain kernel's time, docs/results.md), so
        # those forms load the next step's x (and norm weight, or up) one step ahead by hand
        if NORM or SWIGLU:
            a_nx = tl.load(x_base, mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
            if SWIGLU:
                u_nx = tl.load(x_base + K, mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
            if NORM:
                g_nx = tl.load(g_ptr + rk, mask=rk < K, other=0.0)
        for k in range(0, K, BK):
            if EVEN_K:
                w = tl.load(w_base + k, mask=n_ok[:, None], other=0.0)
            else:
                w = tl.load(w_base + k, mask=n_ok[:, None] & ((k + rk) < K)[None, :], other=0.0)
            if NORM or SWIGLU:
                a = a_nx
                nx_ok = (k + BK + rk) < K
                a_nx = tl.load(x_base + k + BK, mask=m_ok[:, None] & nx_ok[None, :], other=0.0)
                if SWIGLU:
                    u = u_nx
                    u_nx = tl.load(x_base + K + k + BK, mask=m_ok[:, None] & nx_ok[None, :], other=0.0)
                    af = a.to(tl.float32)
                    a = (af * tl.sigmoid(af) * u.to(tl.float32)).to(w.dtype)
                if NORM:
                    g = g_nx
                    g_nx = tl.load(g_ptr + k + BK + rk, mask=nx_ok, other=0.0)
                    af = a.to(tl.float32)
                    ss += af * af
                    a = (af * g.to(tl.float32)[None, :]).to(w.dtype)
            elif EVEN_K:
                a = tl.load(x_base + k, mask=m_ok[:, None], other=0.0)
            else:
                a = tl.load(x_base + k, mask=m_ok[:, None] & ((k + rk) < K)[None, :], other=0.0)
            if ROWWISE:
                acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
            elif F32:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        if NORM:
            acc = acc * (1.0 / tl.sqrt(tl.sum(ss, 1) / K + eps))[:, None]
        y = acc.to(y_ptr.dtype.element_ty)
        if RESID:
            r = tl.load(r_ptr + rm[:, None] * srm + rn[None, :], mask=m_ok[:, None] & n_ok[None, :], other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def launch(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_warps: int, num_stages: int,
           norm: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 16, K] (rows contiguous), w [N, K] (rows contiguous) -> x @ w.T [M, N] in x's dtype. The fused
    forms (`fused_linear` says what each computes): norm, a [K] RMS-norm weight applied to x with eps; swiglu, x
    is [M, 2K] = [gate | up]; residual, an [M, N] tensor (rows contiguous) added to the rounded product."""
    m, k = x.shape
    if swiglu:
        k //= 2
    n = w.shape[0]
    assert m <= BLOCK_M and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    assert not (swiglu and norm is not None), "a norm and the SwiGLU input do not combine"
    assert norm is None or (norm.shape == (k,) and norm.is_contiguous())
    assert residual is None or (residual.shape == (m, n) and residual.stride(1) == 1)
    if w.numel() > MAX_WEIGHT_ELEMENTS:
        raise ValueError(f"a weight of {w.numel()} elements is past the kernel's int32 indexing")
    y = x.new_empty((m, n))
    r = residual if residual is not None else y  # unread without RESID
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, norm if norm is not None else w, r, m, n, k, x.stride(0), w.stride(0), y.stride(0), r.stride(0),
        float(eps), BM=BLOCK_M, BN=block_n, BK=block_k, EVEN_K=k % block_k == 0, F32=x.dtype == torch.float32,
        ROWWISE=INTERPRET, NORM=norm is not None, SWIGLU=swiglu, RESID=residual is not None,
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

    @torch.library.custom_op("flashpd::skinny_fused", mutates_args=())
    def _skinny_fused_op(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None, eps: float, swiglu: bool,
                         residual: torch.Tensor | None) -> torch.Tensor:
        return launch(x, w, *tile(w.shape[0], w.shape[1]), norm=norm, eps=eps, swiglu=swiglu, residual=residual)

    @_skinny_fused_op.register_fake
    def _(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None, eps: float, swiglu: bool,
          residual: torch.Tensor | None) -> torch.Tensor:
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


def fused_applies(x: torch.Tensor, rows: int) -> bool:
    """Whether `fused_linear` runs for `rows` rows like x: ENABLED, triton on CUDA in bf16 or fp16 (as `applies`),
    or under the interpreter in any float dtype (the engine's fused layers in CPU tests), at most MAX_ROWS rows."""
    if not FUSED_ENABLED or triton is None or rows > MAX_ROWS:
        return False
    if INTERPRET:
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def fused_linear(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
                 swiglu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (at most 16 rows in all) -> [..., N], one launch of the kernel with what would be kernels of
    their own around the matmul:
    - norm: rms_norm(x, norm, eps) @ w.T, as (x * norm) @ w.T scaled by each row's 1/rms: the rows are not normed
      and rounded before the matmul, so the result rounds differently from the unfused steps (the same whatever
      the row count, as every form of the kernel);
    - swiglu: x is [..., 2K], [gate | up]; (silu(gate) * up, in fp32, rounded) @ w.T;
    - residual [..., N]: residual + the rounded product, rounded (bitwise the unfused `residual + x @ w.T`)."""
    if triton is None:
        raise RuntimeError("fused_linear needs triton")
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    r2 = residual.reshape(-1, residual.shape[-1]).contiguous() if residual is not None else None
    y = torch.ops.flashpd.skinny_fused(x2, w.contiguous(), norm, float(eps), swiglu, r2)
    return y.view(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) without bias: the kernel where `applies`, else F.linear."""
    if applies(x.device, x.dtype, x.numel() // x.shape[-1], w.numel()) and w.dtype == x.dtype:
        return skinny_linear(x, w)
    return F.linear(x, w)

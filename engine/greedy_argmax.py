"""A row's argmax over the vocabulary in one pass: Triton kernels for sampling.greedy_tokens on a GPU.

`greedy_tokens` in plain PyTorch is two reductions over chunks of each row (the maximum, then the least index
holding it), so compiled it reads the logits twice: at batch 128 (128 rows of 151,936 bf16 logits, 39 MB) its two
kernels took 72 µs a step on an H200. Here each program reads one chunk of one row once and keeps, for it, the
maximum and the least index holding it (the least NaN's index if it holds a NaN), and a second kernel merges a
row's chunks: the maximum of their maxima, then the least index among the chunks that hold it (the least NaN's
if any chunk holds one). Every step is exact in any order, so the token is `logits.argmax(-1)`'s (the first
maximum; the first NaN if any) by construction, whatever the chunking, batch or kernel.
"""
from __future__ import annotations

import torch

from flashpd.engine.triton_env import INTERPRET, tl, triton  # triton None: greedy_tokens' reductions only

BLOCK = 1024  # entries a program loads at a time
CHUNK_PROGRAMS = 2048  # rows x chunks of the first kernel, about: enough loads in flight for the whole GPU
MIN_CHUNK = 2048  # entries a chunk holds at the least (a program's loop runs at least two blocks)
ENABLED = True  # off: greedy_tokens keeps its two compiled reductions (an A/B; the same tokens either way)


def available() -> bool:
    return triton is not None


def applies(logits: torch.Tensor) -> bool:
    """Rows of logits [..., V] this takes: triton on CUDA (or the interpreter, on the CPU), a float dtype."""
    return ENABLED and triton is not None and (logits.is_cuda or INTERPRET) and logits.dtype in (
        torch.float32, torch.bfloat16, torch.float16)


def chunk_size(rows: int, v: int) -> int:
    """Entries of a row a program takes (a multiple of BLOCK; the row's last chunk shorter): about CHUNK_PROGRAMS
    programs over all rows, each chunk of MIN_CHUNK entries or more."""
    per_row = max(1, min(CHUNK_PROGRAMS // max(rows, 1), v // MIN_CHUNK))
    return _cdiv(_cdiv(v, per_row), BLOCK) * BLOCK


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


if triton is not None:
    @triton.jit
    def _chunk_kernel(x_ptr, m_ptr, i_ptr, V, sx, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Row `program_id(0)`, chunk `program_id(1)` of CHUNK entries: its maximum and the least index holding it
        (a NaN's maximum is NaN, its index the chunk's least NaN's)."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        n = tl.num_programs(1)
        lo = c * CHUNK
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: the max of the non-NaN entries seen
        mi = tl.full([BLOCK], V, tl.int32)  # and the least index holding it
        ni = tl.full([BLOCK], V, tl.int32)  # the least NaN index seen
        for start in range(lo, lo + CHUNK, BLOCK):
            idx = start + offs
            x = tl.load(x_ptr + r * sx + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            nan = x != x
            ni = tl.minimum(ni, tl.where(nan & (idx < V), idx, V))
            better = (x > m) | ((x == m) & (mi == V) & (idx < V))  # a later lane index only wins by a larger value
            m = tl.where(better & ~nan, x, m)
            mi = tl.where(better & ~nan, idx, mi)
        top = tl.max(m, 0)
        first = tl.min(tl.where((m == top) & (mi < V), mi, V), 0)
        first_nan = tl.min(ni, 0)
        has_nan = first_nan < V
        tl.store(m_ptr + r * n + c, tl.where(has_nan, float("nan"), top))
        tl.store(i_ptr + r * n + c, tl.where(has_nan, first_nan, first))

    @triton.jit
    def _merge_kernel(m_ptr, i_ptr, out_ptr, N, V, NP: tl.constexpr):
        """Row `program_id(0)`: the chunks' maximum, then the least index among the chunks that hold it (the least
        NaN index if a chunk holds a NaN)."""
        r = tl.program_id(0)
        c = tl.arange(0, NP)
        ok = c < N
        m = tl.load(m_ptr + r * N + c, mask=ok, other=float("-inf"))
        i = tl.load(i_ptr + r * N + c, mask=ok, other=V)
        nan = m != m
        first_nan = tl.min(tl.where(nan, i, V), 0)
        top = tl.max(tl.where(nan, float("-inf"), m), 0)
        first = tl.min(tl.where(ok & ~nan & (m == top), i, V), 0)
        tl.store(out_ptr + r, tl.where(first_nan < V, first_nan, first).to(tl.int64))

    @torch.library.custom_op("flashpd::greedy_argmax", mutates_args=())
    def _greedy_argmax_op(logits: torch.Tensor) -> torch.Tensor:
        v = logits.shape[-1]
        x = logits.reshape(-1, v)
        rows = x.shape[0]
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        if rows:
            size = chunk_size(rows, v)
            n = _cdiv(v, size)
            m_ws = torch.empty((rows, n), dtype=torch.float32, device=logits.device)
            i_ws = torch.empty((rows, n), dtype=torch.int32, device=logits.device)
            _chunk_kernel[(rows, n)](x, m_ws, i_ws, v, x.stride(0), CHUNK=size, BLOCK=BLOCK, num_warps=4)
            _merge_kernel[(rows,)](m_ws, i_ws, out, n, v, NP=max(16, triton.next_power_of_2(n)), num_warps=1)
        return out.view(logits.shape[:-1])

    @_greedy_argmax_op.register_fake
    def _(logits: torch.Tensor) -> torch.Tensor:
        return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] int64: logits.argmax(-1) (the first maximum; the first NaN if any). `applies`
    first."""
    if triton is None:
        raise RuntimeError("greedy_argmax needs triton")
    assert logits.shape[-1] < 2 ** 31 - 1
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return torch.ops.flashpd.greedy_argmax(logits)

"""Attention over the paged KV cache in plain PyTorch.

Each layer writes this forward's K/V into its slots first, then gathers the sequence's blocks
through its block table and runs SDPA with a position mask (key j visible to a query at
position p iff j <= p). Grouped-query attention folds the query groups into the query axis
([kv_heads, B, T*groups, d], kv-major: see `group_queries`) so K/V are never repeated in memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashpd.engine import paged_attention


@dataclass
class AttnBatch:
    """Per-forward metadata, shared by every layer.

    positions: [B, T] absolute positions (padding rows use 0); slots: [B*T] flat cache slots
    (padding writes the scratch block); block_tables: [B, nblk] (padded with the scratch block);
    mask: set by the model from the positions and tables (qwen3.step_inputs), grouped for
    `grouped_attention`: [1, B, T*groups, nblk*kv_block_size] boolean, True = visible.
    fresh: every row starts at position 0 (a prompt with no cached prefix): attention then needs only
    this forward's own K/V under a causal mask, which a fused causal kernel runs without gathering the
    cache or reading a mask (`causal_sdpa`); there is no mask. Right padding is harmless there: a real
    query never sees a later (padding) key.
    continued: set by the model where `use_continued` holds (one row continuing a cached prefix on a GPU: a
    prompt's later prefill chunks, a prefix hit's tail): its attention is `continued_sdpa`; there is no mask.
    impl: None chooses the attention form per shape and device (`use_matmul`, `use_paged`); "matmul" or
    "sdpa" forces that form of `grouped_attention` on any device (ModelRunner sets it from
    RunnerConfig.attention_impl: tests, kernel checks).
    """

    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor | None = None
    fresh: bool = False
    impl: str | None = None
    continued: bool = False


def causal_position_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    keys = torch.arange(num_keys, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)


def write_kv(k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_slots: a layer's K cache as [blocks*kv_block_size, kv_heads, d] (a view made by the caller); k: [N,
    kv_heads, d]; slots: [N]. The scatter mutates its argument itself, not a view made here: compiled
    (inside `attn_inputs`), Inductor then stores K/V from the kernel that computes them, where a view
    made inside the compiled function would make it copy the whole layer cache out and back."""
    k_slots.index_put_((slots,), k.to(k_slots.dtype))
    v_slots.index_put_((slots,), v.to(v_slots.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[blocks, bs, kv_heads, d] gathered by [B, nblk] -> [kv_heads, B, nblk*bs, d] (the kv-major layout of
    `grouped_attention`; compiled, the gather kernel writes it directly)."""
    b, n = block_tables.shape
    g = cache[block_tables]
    return g.view(b, n * cache.shape[1], cache.shape[2], cache.shape[3]).permute(2, 0, 1, 3)


def group_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, 1, T, L] -> [1, B, T*groups, L], the query layout of `group_queries` (built once per forward)."""
    b, _, t, n = mask.shape
    return mask.unsqueeze(3).expand(b, 1, t, groups, n).reshape(b, 1, t * groups, n).transpose(0, 1)


# Scores of at most this many elements take the explicit-matmul form on a GPU (see `use_matmul`).
MATMUL_MAX_SCORES = 1 << 22


def use_matmul(q: torch.Tensor, keys: int, impl: str | None = None) -> bool:
    """Small query sets (decode, verify, draft blocks) over a long, padded key range: a masked fused
    SDPA kernel runs them on a few thread blocks that walk every key in turn, several times slower on a
    GPU than two matmuls and a softmax (docs/results.md); large score matrices (prefill) keep the fused
    kernel. `impl` ("matmul" or "sdpa", AttnBatch.impl) forces one on any device."""
    if impl is not None:
        return impl == "matmul"
    rows = q.shape[0] * q.shape[1] * q.shape[2]  # B*T*Hq, in either query layout
    return q.device.type == "cuda" and rows * keys <= MATMUL_MAX_SCORES


def use_paged(q: torch.Tensor, t: int, impl: str | None = None) -> bool:
    """Decode and verify (q [Hkv, B, T*G, d], T <= PAGED_MAX_T) on a GPU read K/V straight from the paged
    cache (engine/paged_attention.py), at every batch size and context length: the gather of `gather_kv`
    copies every row's whole padded KV first and the masked softmax reads a mask, which triples a step's KV
    traffic at large batches; and the gathered form's kernels (a cuBLAS bmm whose reduction runs over the
    padded key count, a softmax tuned per length) may round a position differently by how long the table is
    when it runs, so a DFlash verify and a native decode of one token could part in bf16. The kernel's row
    bits depend only on the row's own position and keys (its docstring), at any width and batch.

    A decode of one row (8 programs at Qwen3-8B's shape, one per KV head) or a verify runs a program per key
    chunk and a merge (paged_attention.use_split), with the same bits as one program per row. Prefill chunks
    (wider than PAGED_MAX_T: a 16-row tile per 4 tokens would re-read every key per tile), the CPU and a forced
    `impl` (AttnBatch.impl) keep `grouped_attention` too."""
    return paged_applies(q.device, t, impl)


def paged_applies(device: torch.device, t: int, impl: str | None = None) -> bool:
    """`use_paged` for a forward of T tokens a row on `device` (at any batch), decided before its queries exist
    (the forward builds the gather path's position mask only when this is False). impl "paged" forces the
    kernel on any device (the drafter's paged pass under triton's CPU interpreter, in tests)."""
    if t > PAGED_MAX_T or not paged_attention.available():
        return False
    return impl == "paged" or (impl is None and device.type == "cuda")


# The widest forward the paged kernel takes: DFlash verify blocks (16) with room to spare.
PAGED_MAX_T = 32

# The layouts of a layer's queries (qwen3.attn_inputs): kv-major groups for `grouped_attention` and the paged
# kernel, heads-major [B, Hq, T, d] for `causal_sdpa`, tokens [B*T, Hq, d] for `continued_sdpa`.
Q_GROUPED, Q_HEADS, Q_TOKENS = "grouped", "heads", "tokens"


def use_continued(device: torch.device, b: int, t: int, dtype: torch.dtype, head_dim: int,
                  impl: str | None = None) -> bool:
    """Whether a forward of one row of T > PAGED_MAX_T tokens after a cached prefix (not fresh: the caller
    checks) takes `continued_sdpa`: a CUDA GPU of compute capability 8.0 or more (flash attention's), bf16 or
    fp16, a head size flash takes, and no forced form. Elsewhere (batches of several rows, the CPU, float32,
    a forced `impl`) it keeps `grouped_attention` over the gathered cache with its position mask."""
    if impl is not None or b != 1 or t <= PAGED_MAX_T or device.type != "cuda":
        return False
    if dtype not in (torch.bfloat16, torch.float16) or head_dim % 8 or head_dim > 256:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def continued_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   positions: torch.Tensor, scale: float) -> torch.Tensor:
    """One row's attention over its cached prefix and its own new keys (`use_continued`): queries q [T, Hq, d]
    (attn_inputs' Q_TOKENS, this forward's K/V already in the cache), k_cache / v_cache a layer's [blocks, bs,
    Hkv, d], block_tables [1, nblk], positions [1, T] (columns past the row's tokens, right padding, carry 0).
    -> [1, T, Hq*d] (o_proj's input), padding rows zero.

    Flash attention's variable-length form with causality aligned to the keys' end: the row's keys are its
    gathered blocks, of which the first `max(positions) + 1` are used (seqused_k), and its real queries are the
    last of them, so query i sees the keys up to its own position. No [T, L] mask is built or read, and
    key tiles past a query's position are skipped. The masked form it replaces ran the whole [T*groups, L]
    score matrix under a mask, and took a chunked 8,192-token prefill at Qwen3-8B's shape well past one
    forward's time (docs/results.md). Graph-safe: lengths stay on the device; the maxima are the shapes'."""
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    n_keys = block_tables.shape[1] * bs
    k = k_cache[block_tables[0]].view(n_keys, hkv, d)
    v = v_cache[block_tables[0]].view(n_keys, hkv, d)
    used = positions.max().view(1) + 1  # the row's keys: its prefix and its real tokens
    real = used - positions[0, 0]  # its real queries (the first columns)
    zero = torch.zeros_like(used)
    cu_q = torch.cat([zero, real]).to(torch.int32)
    cu_k = torch.cat([zero, zero + n_keys]).to(torch.int32)
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, t, n_keys, 0.0, True, False, scale=scale,
                                                  seqused_k=used.to(torch.int32))[0]
    keep = torch.arange(t, device=q.device)[:, None, None] < real  # rows past the row's tokens: never written
    return torch.where(keep, out, 0).view(1, t, hq * d)


def group_queries(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, T, Hq, d] -> [Hkv, B, T*groups, d]: kv-major, each KV head's query groups folded into its query
    axis token-major (row t*groups + j is query head kv*groups + j at token t, GQA's usual head order).

    Why this layout: attention's output [Hkv, B, T*groups, d] is then [Hkv, B*T, groups*d] as a view, which
    `out_proj` multiplies per KV head with no copy. A [B, T, Hq*d] output needs a permute copy at T > 1:
    one more kernel per layer of every verify and draft pass (a visible share of a small model's DFlash
    step: docs/results.md), and none in a one-token decode. A layer's `attn_inputs` writes its queries in
    this layout from the kernel that ropes them."""
    b, t, hq, d = q.shape
    return q.view(b, t, n_kv, hq // n_kv, d).permute(2, 0, 1, 3, 4).reshape(n_kv, b, -1, d)


def grouped_attention(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, impl: str | None = None) -> torch.Tensor:
    """qg: [Hkv, B, T*groups, d] (group_queries); k, v: [Hkv, B, L, d] (gather_kv); mask: [1, B,
    T*groups, L] (group_mask) or None. Returns [Hkv, B, T*groups, d] in the query layout (see
    `out_proj`). Every query row must see at least one key. impl: see `use_matmul`."""
    if use_matmul(qg, k.shape[2], impl):
        s = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)


def out_proj(attn: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """The output projection of `grouped_attention`'s [Hkv, B, T*groups, d] -> [B, T, H].

    Up to OUT_PROJ_SUM_MAX_T tokens a row (verify and draft blocks, a CPU decode): one batched matmul over KV
    heads ([Hkv, B*T, groups*d] by w_o's per-head column slices, views both) and their sum, which compiled is
    folded into the kernel that adds the residual (a reduction this short is unrolled). Wider (a prefill chunk
    after a cached prefix, training's whole sequences): `heads_last`'s one copy and one plain matmul. There the
    fused sum is a reduction across the [Hkv, B*T, H] partials that inductor runs far from the copy rate: 1.26
    ms a layer for a 1,024-token chunk at Qwen3-8B's shape, which made a chunked 2,048-token prefill take twice
    the time of one forward (docs/results.md). Per head, the columns of w_o [H, Hq*d] are the heads
    kv*groups .. kv*groups + groups - 1."""
    hkv, b = attn.shape[0], attn.shape[1]
    h_out = w_o.shape[0]
    t = attn.shape[2] * hkv * attn.shape[3] // w_o.shape[1]
    if t > OUT_PROJ_SUM_MAX_T:
        return F.linear(heads_last(attn, t), w_o)
    x = attn.reshape(hkv, -1, w_o.shape[1] // hkv)
    w = w_o.view(h_out, hkv, -1).permute(1, 2, 0)
    return torch.bmm(x, w).sum(0).view(b, -1, h_out)


# The widest block (tokens a row) whose output projection sums per-KV-head matmuls (`out_proj`).
OUT_PROJ_SUM_MAX_T = 32


def heads_last(attn: torch.Tensor, t: int) -> torch.Tensor:
    """`grouped_attention`'s (or the paged kernel's) [Hkv, B, T*groups, d] -> [B, T, Hq*d], query heads in
    o_proj's column order (head kv*groups + j), for one plain matmul by o_proj (one copy)."""
    hkv, b, tg, d = attn.shape
    return attn.view(hkv, b, t, tg // t, d).permute(1, 2, 0, 3, 4).reshape(b, t, -1)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float, impl: str | None = None) -> torch.Tensor:
    """`grouped_attention` of q [B, T, Hq, d] and k, v [B, Hkv, L, d] under a `group_mask` mask ->
    [B, T, Hq*d] (tests and micro-benchmarks; the model's gather path keeps the kv-major layout)."""
    out = grouped_attention(group_queries(q, k.shape[1]), k.transpose(0, 1), v.transpose(0, 1), mask, scale, impl)
    return heads_last(out, q.shape[1])


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Fresh-prefill attention: queries q [B, Hq, T, d] (attn_inputs with fresh=True) over this forward's
    own k, v [B*T, Hkv, d], causal.

    Returns [B, T, Hq*d] (one copy out of SDPA's head layout), which the layer multiplies by o_proj whole:
    at prefill widths the kv-major form's batched matmul takes a copy of the weight and a memset besides (two
    more kernels a layer). The same numbers as `grouped_attention` and `out_proj` over the cache for
    rows that start at 0, up to the rounding of a differently ordered sum, without the cache gather or the
    [T, L] mask: a 2,000-token prompt's prefill is a flash kernel instead of a masked one. T stays -1:
    compiled for prompts of many lengths, T is symbolic."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    k = k.view(b, -1, hkv, d).transpose(1, 2)
    v = v.view(b, -1, hkv, d).transpose(1, 2)
    # enable_gqa always: one group per KV head is plain multi-head attention. Not `hq != hkv`: in a process
    # that compiles this for two models (dynamo's cache is per function), the head counts turn symbolic and
    # the comparison is a SymBool, which SDPA refuses
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(b, -1, hq * d)

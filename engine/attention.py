"""Attention over the paged KV cache in plain PyTorch.

Each layer writes this forward's K/V into its slots first, then gathers the sequence's blocks
through its block table and runs SDPA with a position mask (key j visible to a query at
position p iff j <= p). Grouped-query attention folds the query groups into the query axis
([B, kv_heads, groups*T, d]) so K/V are never repeated in memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnBatch:
    """Per-forward metadata, shared by every layer.

    positions: [B, T] absolute positions (padding rows use 0); slots: [B*T] flat cache slots
    (padding writes the scratch block); block_tables: [B, nblk] (padded with the scratch block);
    mask: set by the model from the positions and tables (qwen3.step_inputs), grouped for
    `grouped_attention`: [B, 1, groups*T, nblk*block_size] boolean, True = visible.
    fresh: every row starts at position 0 (a prompt with no cached prefix): attention then needs only
    this forward's own K/V under a causal mask, which a fused causal kernel runs without gathering the
    cache or reading a mask (`causal_sdpa`); there is no mask. Right padding is harmless there: a real
    query never sees a later (padding) key.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor | None = None
    fresh: bool = False


def causal_position_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    keys = torch.arange(num_keys, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)


def write_kv(k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_slots: a layer's K cache as [blocks*block_size, kv_heads, d] (a view made by the caller); k: [N,
    kv_heads, d]; slots: [N]. The scatter mutates its argument itself, not a view made here: compiled
    (inside `attn_inputs`), Inductor then stores K/V from the kernel that computes them, where a view
    made inside the compiled function would make it copy the whole layer cache out and back."""
    k_slots.index_put_((slots,), k.to(k_slots.dtype))
    v_slots.index_put_((slots,), v.to(v_slots.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[blocks, bs, kv_heads, d] gathered by [B, nblk] -> [B, kv_heads, nblk*bs, d]."""
    b, n = block_tables.shape
    g = cache[block_tables]
    return g.view(b, n * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def group_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, 1, T, L] -> [B, 1, groups*T, L], the query layout of `grouped_sdpa` (built once per forward)."""
    b, _, t, n = mask.shape
    return mask.unsqueeze(2).expand(b, 1, groups, t, n).reshape(b, 1, groups * t, n)


# Scores of at most this many elements take the explicit-matmul form on a GPU (see `use_matmul`).
MATMUL_MAX_SCORES = 1 << 22
FORCE_IMPL: str | None = None  # tests: "matmul" or "sdpa" on any device


def use_matmul(q: torch.Tensor, keys: int) -> bool:
    """Small query sets (decode, verify, draft blocks) over a long, padded key range: a masked fused
    SDPA kernel runs them on a few thread blocks that walk every key in turn (on an H200, 68 us per
    call at 4,096 keys for the demo pair against 14 us as two matmuls and a softmax, from
    bench/results/attn_micro_h200.json); large score matrices (prefill) keep the fused kernel."""
    if FORCE_IMPL is not None:
        return FORCE_IMPL == "matmul"
    rows = q.shape[0] * q.shape[1] * q.shape[2]  # B*T*Hq, in either query layout (group_queries)
    return q.device.type == "cuda" and rows * keys <= MATMUL_MAX_SCORES


def group_queries(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, T, Hq, d] -> [B, Hkv, (Hq/Hkv)*T, d]: each KV head's query groups folded into its query axis
    (group-major). Query head h = kv * groups + j reads KV head kv, as in GQA's usual head order, so a view
    [B, Hq, T, d] of this layout is the per-head layout SDPA takes. A layer's `attn_inputs` writes its
    queries in this layout from the kernel that ropes them: at T > 1 a permute here would be a copy."""
    b, _, hq, d = q.shape
    return q.view(b, -1, n_kv, hq // n_kv, d).permute(0, 2, 3, 1, 4).reshape(b, n_kv, -1, d)


def grouped_attention(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, n_q: int) -> torch.Tensor:
    """qg: [B, Hkv, groups*T, d] (group_queries) of n_q heads; k, v: [B, Hkv, L, d]; mask: [B, 1,
    groups*T, L] (see group_mask) or None. Returns [B, T, Hq*d]. Every query row must see at least one
    key. Shapes follow from the int head count, T stays -1 (symbolic when compiled for many widths)."""
    b, hkv, _, d = qg.shape
    if use_matmul(qg, k.shape[2]):
        s = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)
    else:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.view(b, hkv, n_q // hkv, -1, d).permute(0, 3, 1, 2, 4).reshape(b, -1, n_q * d)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """`grouped_attention` of queries q [B, T, Hq, d] in the usual layout."""
    return grouped_attention(group_queries(q, k.shape[1]), k, v, mask, scale, q.shape[2])


def causal_sdpa(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, n_q: int) -> torch.Tensor:
    """Fresh-prefill attention: queries qg [B, Hkv, groups*T, d] (group_queries) of n_q heads over this
    forward's own k, v [B*T, Hkv, d], causal.

    Returns [B, T, Hq*d]. The same numbers as `grouped_attention` over the cache for rows that start at 0
    (up to the kernels' rounding), without the cache gather or the [T, L] mask: a 2,000-token prompt's
    prefill is a flash kernel instead of a masked one. The head count comes in as an int and T stays -1:
    compiled for prompts of many lengths, T is symbolic, and a head count derived from it would be too."""
    b, hkv, _, d = qg.shape
    k = k.view(b, -1, hkv, d).transpose(1, 2)
    v = v.view(b, -1, hkv, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(qg.view(b, n_q, -1, d), k, v, is_causal=True, scale=scale,
                                         enable_gqa=n_q != hkv)
    return out.transpose(1, 2).reshape(b, -1, n_q * d)

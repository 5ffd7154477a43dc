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
    mask: [B, 1, T, nblk*block_size] boolean, True = visible (grouped once per forward by the model).
    fresh: every row starts at position 0 (a prompt with no cached prefix): attention then needs only
    this forward's own K/V under a causal mask, which a fused causal kernel runs without gathering the
    cache or reading a mask (`causal_sdpa`); `mask` is unused. Right padding is harmless there: a real
    query never sees a later (padding) key.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor
    fresh: bool = False


def causal_position_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    keys = torch.arange(num_keys, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache: [blocks, block_size, kv_heads, d]; k: [N, kv_heads, d]; slots: [N]."""
    kh, d = k_cache.shape[-2:]
    k_cache.view(-1, kh, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kh, d).index_copy_(0, slots, v.to(v_cache.dtype))


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
    b, t, hq, _ = q.shape
    return q.device.type == "cuda" and b * hq * t * keys <= MATMUL_MAX_SCORES


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """q: [B, T, Hq, d]; k, v: [B, Hkv, L, d]; mask: [B, 1, (Hq/Hkv)*T, L] (see group_mask) or None.

    Returns [B, T, Hq*d]. Every query row must see at least one key."""
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    if use_matmul(q, k.shape[2]):
        s = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)
    else:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, hq * d)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Fresh-prefill attention: q [B, T, Hq, d] over this forward's own k, v [B*T, Hkv, d], causal.

    Returns [B, T, Hq*d]. The same numbers as `grouped_sdpa` over the cache for rows that start at 0
    (up to the kernels' rounding), without the cache gather or the [T, L] mask: a 2,000-token prompt's
    prefill is a flash kernel instead of a masked one."""
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    k = k.view(b, t, hkv, d).transpose(1, 2)
    v = v.view(b, t, hkv, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=scale,
                                         enable_gqa=hq != hkv)
    return out.transpose(1, 2).reshape(b, t, hq * d)

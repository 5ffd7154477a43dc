"""Read and write a sequence's positions in the paged caches: the engine side of KV transfer.

Both halves use the same slots (one block table drives the target cache and the drafter's
context cache), so a range of positions exports as target K/V [layers, 2, T, kv, d] plus draft
K/V [draft_layers, 2, T, kv, d], and imports back into any free blocks bit for bit.
"""
from __future__ import annotations

import numpy as np
import torch

from flashpd.engine.kv_cache import BlockTable, slots_of


def position_slots(table: BlockTable, start: int, end: int, kv_block_size: int, device: torch.device) -> torch.Tensor:
    p = np.arange(start, end)
    blocks = np.asarray(table.blocks, dtype=np.int64)
    if len(blocks) * kv_block_size < end:
        raise ValueError(f"positions up to {end} are not backed by this table's {len(blocks)} blocks")
    return torch.from_numpy(slots_of(blocks, p, kv_block_size)).to(device)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    n_l, two, nb, bs, h, d = cache.shape
    return cache.view(n_l, two, nb * bs, h, d)


def read_positions(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[layers, 2, T, kv, d] copy of the given slots."""
    return _flat(cache).index_select(2, slots)


def write_positions(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    flat = _flat(cache)
    if values.shape[:2] != flat.shape[:2] or values.shape[3:] != flat.shape[3:] or values.shape[2] != slots.numel():
        raise ValueError(f"KV of shape {list(values.shape)} does not fit a cache of shape {list(cache.shape)} "
                         f"at {slots.numel()} positions")
    if values.dtype != cache.dtype:
        raise ValueError(f"KV dtype {values.dtype} != cache dtype {cache.dtype}")
    flat.index_copy_(2, slots, values.to(cache.device))

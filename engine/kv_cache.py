"""Paged KV cache: fixed-size blocks, a block table per sequence, allocate / free / truncate.

One `BlockAllocator` hands out block ids; any number of `PagedKVCache` tensors (the target's,
later the drafter's context cache) are indexed by the same block tables, so one table per
sequence drives them all. Block 0 is a scratch block that is never handed out: padded
positions of a batch write there, which keeps every write a static-shape scatter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SCRATCH_BLOCK = 0


class OutOfBlocks(RuntimeError):
    """The cache has too few free blocks for the request (the caller decides: wait, preempt, refuse)."""


@dataclass
class BlockTable:
    """The blocks of one sequence, in order, and how many positions hold valid KV."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockAllocator:
    """A free list of block ids 1..num_blocks-1 (0 is scratch). It knows which blocks it handed out: giving back
    one it did not (a block freed twice, the scratch block, an id out of range) raises before anything changes,
    since two sequences sharing a block would read each other's KV silently."""

    def __init__(self, num_blocks: int, kv_block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("a paged cache needs at least 2 blocks (block 0 is scratch)")
        self.num_blocks = num_blocks
        self.kv_block_size = kv_block_size
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._out = bytearray(num_blocks)  # 1: handed out (in some table)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        return max(0, math.ceil(num_tokens / self.kv_block_size) - len(table.blocks))

    def ensure(self, table: BlockTable, num_tokens: int) -> None:
        """Give `table` enough blocks to hold `num_tokens` positions (does not move num_tokens)."""
        need = self.blocks_needed(table, num_tokens)
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} KV blocks, {self.num_free} free")
        for _ in range(need):
            b = self._free.pop()
            self._out[b] = 1
            table.blocks.append(b)

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Roll a sequence back to `num_tokens` valid positions and free the blocks past them.

        KV written past the new length is simply never read again (attention masks by position),
        so speculative rollback costs no copy.
        """
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"cannot truncate a sequence of {table.num_tokens} tokens to {num_tokens}")
        keep = math.ceil(num_tokens / self.kv_block_size)
        self._give_back(table.blocks[keep:])
        table.num_tokens = num_tokens
        del table.blocks[keep:]

    def free(self, table: BlockTable) -> None:
        self._give_back(table.blocks)
        table.blocks.clear()
        table.num_tokens = 0

    def _give_back(self, blocks: list[int]) -> None:
        """Blocks back to the free list (the last first, so the next ensure takes them back in order)."""
        for b in blocks:
            if not (0 < b < self.num_blocks and self._out[b]):
                raise RuntimeError(f"KV block {b} was not handed out (freed twice, or not this allocator's): "
                                   f"{len(blocks)} blocks given back, none freed")
        if len(set(blocks)) != len(blocks):
            raise RuntimeError(f"a block table holds a KV block twice: {sorted(blocks)}")
        for b in reversed(blocks):
            self._out[b] = 0
            self._free.append(b)


class PagedKVCache:
    """K and V for `num_layers` layers: one tensor [layers, 2, blocks, kv_block_size, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, kv_block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.kv_block_size = kv_block_size
        self.num_blocks = num_blocks
        self.data = torch.zeros(num_layers, 2, num_blocks, kv_block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)


def blocks_needed(prompt_len: int, max_tokens: int, width: int, kv_block_size: int) -> int:
    """Worst-case KV blocks of one request: prompt + every output token + one block of drafts (width 1 for
    native decoding). A request needing more than a worker's whole cache can never run there."""
    return math.ceil((prompt_len + max_tokens + width) / kv_block_size)


def slots_of(blocks, pos, kv_block_size: int):
    """The paged cache's one slot rule: position p of a sequence lives at flat slot
    blocks[p // kv_block_size] * kv_block_size + p % kv_block_size. `blocks` is one block table (a numpy array, `pos`
    numpy positions) or a batch of them as a tensor [B, nblk] (`pos` [B, T]; block indices clamped in range,
    so padded rows stay graph-safe: their callers send them to the scratch block)."""
    if isinstance(blocks, torch.Tensor) and blocks.dim() == 2:
        blk = blocks.gather(1, (pos // kv_block_size).clamp(0, blocks.shape[1] - 1))
    else:
        blk = blocks[pos // kv_block_size]
    return blk * kv_block_size + pos % kv_block_size

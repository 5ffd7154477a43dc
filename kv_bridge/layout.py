"""What a reader expects of a chunk: its geometry, dtype, token count and method fingerprint.

A chunk that verifies (its MAC, its header schema, its own lengths) can still be unusable here:
another model's shapes, another dtype, a chunk of the wrong length, another method's entry. A
reader checks the chunk against its ChunkLayout before building tensors from the bytes (stores,
the bridge client) and before writing anything into its caches (PrefixCache); a mismatch is a
counted miss, never an exception inside the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flashpd.kv_bridge.chunk import KVChunk

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ITEM_BYTES = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def numel(shape: list[int] | tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class ChunkLayout:
    layers: int
    kv_heads: int
    head_dim: int
    chunk_tokens: int
    dtype: str  # a DTYPES name
    # the drafter's layers; None: this reader writes no draft half (a native request), so one that is
    # present (a full entry read for its target half) is not compared, only length-checked by the chunk
    draft_layers: int | None
    fingerprint: str | None  # the method chain the reader asked for; None: not checked (sizing only)
    draft_kv_heads: int | None = None  # None: the target's
    draft_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if min(self.layers, self.kv_heads, self.head_dim, self.chunk_tokens) <= 0 or \
                (self.draft_layers is not None and self.draft_layers <= 0):
            raise ValueError(f"layout sizes must be positive: {self}")

    @classmethod
    def of_caches(cls, target_cache: torch.Tensor, draft_cache: torch.Tensor | None, chunk_tokens: int,
                  fingerprint: str | None) -> "ChunkLayout":
        """The layout of what fits the paged caches [layers, 2, blocks, kv_block_size, kv_heads, head_dim]."""
        lt, _, _, _, ht, dt = target_cache.shape
        ld, hd, dd = (draft_cache.shape[0], draft_cache.shape[4], draft_cache.shape[5]) if draft_cache is not None \
            else (None, None, None)
        return cls(lt, ht, dt, chunk_tokens, dtype_name(target_cache.dtype), ld, fingerprint, hd, dd)

    @property
    def target_shape(self) -> list[int]:
        return [self.layers, 2, self.chunk_tokens, self.kv_heads, self.head_dim]

    @property
    def draft_shape(self) -> list[int] | None:
        if self.draft_layers is None:
            return None
        return [self.draft_layers, 2, self.chunk_tokens, self.draft_kv_heads or self.kv_heads,
                self.draft_head_dim or self.head_dim]

    def payload_bytes(self) -> int:
        """Bytes of a full chunk's tensors (both halves when the layout has a drafter)."""
        d = self.draft_shape
        return (numel(self.target_shape) + (numel(d) if d is not None else 0)) * ITEM_BYTES[self.dtype]

    def check_header(self, header: dict, payload_bytes: int) -> str | None:
        """Why a chunk with this (schema-checked) header and tensor byte count does not fit, or None."""
        return self._why(header["target_shape"], header["draft_shape"], header["dtype"], header["dtype"],
                         len(header["token_ids"]), header["fingerprint"], payload_bytes)

    def check(self, chunk: "KVChunk") -> str | None:
        """check_header for a chunk already made of tensors (a device tier's, a store's)."""
        d = chunk.draft_kv
        return self._why(list(chunk.target_kv.shape), list(d.shape) if d is not None else None,
                         dtype_name(chunk.target_kv.dtype), dtype_name(d.dtype) if d is not None else None,
                         chunk.num_tokens, chunk.fingerprint, chunk.nbytes())

    def _why(self, target: list[int], draft: list[int] | None, dtype: str, draft_dtype: str | None,
             n_tokens: int, fingerprint: str, payload: int) -> str | None:
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            return "another method's fingerprint"
        if n_tokens != self.chunk_tokens:
            return f"{n_tokens} tokens, this reader takes chunks of {self.chunk_tokens}"
        if dtype != self.dtype or (draft is not None and draft_dtype != self.dtype):
            return f"dtype {dtype}, this reader holds {self.dtype}"
        if list(target) != self.target_shape:
            return f"target K/V {list(target)}, this reader holds {self.target_shape}"
        want = self.draft_shape
        if want is not None and draft is None:
            return "no drafter half"
        if want is not None and list(draft) != want:
            return f"draft K/V {list(draft)}, this reader holds {want}"
        item = ITEM_BYTES[self.dtype]
        exact = (numel(target) + (numel(draft) if draft is not None else 0)) * item
        if payload != exact:
            return f"{payload} tensor bytes, the shapes need {exact}"
        return None

"""One cache entry: a chunk of positions with BOTH halves of the method's state.

target_kv [target_layers, 2, T, kv_heads, head_dim] and, for DFlash, draft_kv [draft_layers, 2, T,
kv_heads, head_dim] (the drafter's context K/V for the same positions, moved as is: bit-exact,
no recompute). They are serialized, checksummed, stored, moved and evicted as one unit.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
import xxhash

_MAGIC = b"FPKV"
_DIGEST = 16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CorruptChunk(ValueError):
    """Bytes that are not a valid chunk (bad magic, short, checksum mismatch): never used."""


@dataclass
class KVChunk:
    key: str
    parent: str  # the previous chunk's key ("" for the first chunk)
    fingerprint: str
    token_ids: list[int]
    target_kv: torch.Tensor
    draft_kv: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def nbytes(self) -> int:
        n = self.target_kv.numel() * self.target_kv.element_size()
        return n + (self.draft_kv.numel() * self.draft_kv.element_size() if self.draft_kv is not None else 0)

    def to_bytes(self) -> bytes:
        """Layout: magic, u32 header length, JSON header, target bytes, draft bytes, 16-byte XXH3-128.

        XXH3 detects corruption (not tampering: the bridge trusts its peers) at memory speed; a
        cryptographic hash capped the bridge at the ~1 GB/s one core hashes."""
        return b"".join(self.to_parts())

    def to_parts(self) -> list[bytes | memoryview]:
        """to_bytes' pieces in order, the tensors' bytes not copied (a same-host writer puts them
        straight into a segment: one copy of the chunk less); b"".join(parts) == to_bytes()."""
        tk = self.target_kv.detach().contiguous().cpu()
        dk = self.draft_kv.detach().contiguous().cpu() if self.draft_kv is not None else None
        header = {"key": self.key, "parent": self.parent, "fingerprint": self.fingerprint,
                  "token_ids": self.token_ids, "dtype": str(tk.dtype).removeprefix("torch."),
                  "target_shape": list(tk.shape), "draft_shape": list(dk.shape) if dk is not None else None}
        hb = json.dumps(header).encode()
        parts = [_MAGIC, struct.pack("<I", len(hb)), hb, _raw(tk)] + ([_raw(dk)] if dk is not None else [])
        h = xxhash.xxh3_128()
        for part in parts:  # hash the tensors in place; the caller copies them once
            h.update(part)
        return parts + [h.digest()]

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, own: bool = False) -> "KVChunk":
        """own: the caller hands over a writable buffer nobody else holds (a segment just taken, a
        stream just assembled), and the tensors are views of it instead of copies: one copy of the
        chunk less on the import path. Otherwise (a store's own bytes) the tensors are copies."""
        h, offsets = verify_bytes(data)
        body = memoryview(data)[:-_DIGEST]
        alias = own and not body.readonly
        dtype = _DTYPES[h["dtype"]]
        tk = _tensor(body, offsets[0], h["target_shape"], dtype, alias)
        dk = _tensor(body, offsets[1], h["draft_shape"], dtype, alias) if h["draft_shape"] is not None else None
        return cls(h["key"], h["parent"], h["fingerprint"], h["token_ids"], tk, dk)


def verify_bytes(data: bytes | memoryview) -> tuple[dict, tuple[int, int]]:
    """Check magic, checksum and lengths without building tensors (what a store or a relay needs).

    Returns the header and the byte offsets of the target and draft tensors."""
    data = memoryview(data)
    if len(data) < 8 + _DIGEST or bytes(data[:4]) != _MAGIC:
        raise CorruptChunk("not a flashpd KV chunk (bad magic or too short)")
    body, digest = data[:-_DIGEST], bytes(data[-_DIGEST:])
    if xxhash.xxh3_128_digest(body) != digest:
        raise CorruptChunk("chunk checksum mismatch")
    (hl,) = struct.unpack("<I", body[4:8])
    try:
        h = json.loads(bytes(body[8:8 + hl]))
        item = torch.empty((), dtype=_DTYPES[h["dtype"]]).element_size()
    except (ValueError, KeyError) as e:
        raise CorruptChunk(f"chunk header is unreadable ({e})") from None
    t_off = 8 + hl
    d_off = t_off + _numel(h["target_shape"]) * item
    end = d_off + (_numel(h["draft_shape"]) * item if h["draft_shape"] is not None else 0)
    if end != len(body):
        raise CorruptChunk("chunk length does not match its header")
    return h, (t_off, d_off)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _raw(t: torch.Tensor) -> memoryview | bytes:
    """The tensor's bytes without copying (t is contiguous and on the CPU)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else b""


def _tensor(body: memoryview, off: int, shape: list[int], dtype: torch.dtype, alias: bool = False) -> torch.Tensor:
    nb = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    if nb == 0:
        return torch.empty(shape, dtype=dtype)
    buf = body[off:off + nb] if alias else bytearray(body[off:off + nb])
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)

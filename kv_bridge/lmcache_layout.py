"""How one flashpd chunk (both halves) is packed into ONE LMCache KV_2LTD memory object.

LMCache stores a chunk as a tensor [2, layers, tokens, kv_heads * head_dim] (K/V first). flashpd
packs its chunk into it as rows: the target's layers, then the drafter's layers, then one header
row. So LMCache allocates, stores, evicts and moves the two halves as one object, and the
bridge's guarantees travel inside it: the header row holds the chunk's key, parent, method
fingerprint and token ids plus a keyed BLAKE3 MAC (the store's cluster secret) over every other
byte of the object, checked on every read before the header is parsed. Pure torch: no LMCache
import here.
"""
from __future__ import annotations

import hmac
import json
import struct
from dataclasses import dataclass

import torch

from flashpd.kv_bridge.auth import MAC_BYTES, MacKey
from flashpd.kv_bridge.chunk import MAX_TOKEN_ID, CorruptChunk, KVChunk, LayoutMismatch, check_identity
from flashpd.kv_bridge.layout import ChunkLayout, dtype_name

_MAGIC = b"FPL2"  # FPLM: XXH3-128 digest; FPL2: keyed BLAKE3 MAC
_TAG = slice(len(_MAGIC), len(_MAGIC) + MAC_BYTES)
_FIXED = len(_MAGIC) + MAC_BYTES + 4  # magic, MAC, u32 length of the JSON header
_KEY_CHARS = 64  # a flashpd key, parent and fingerprint: SHA-256 hex digests (keys.chunk_keys, MethodFingerprint)


@dataclass(frozen=True)
class PackedLayout:
    """The geometry every chunk of one LMCache store has (LMCache fixes it per engine)."""

    target_layers: int
    draft_layers: int  # 0 for a native method (target K/V only)
    kv_heads: int
    head_dim: int
    chunk_tokens: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.target_layers, self.kv_heads, self.head_dim, self.chunk_tokens) <= 0 or self.draft_layers < 0:
            raise ValueError(f"layout sizes must be positive (draft_layers may be 0): {self}")
        need = _FIXED + len(_meta("k" * _KEY_CHARS, "p" * _KEY_CHARS, "f" * _KEY_CHARS,
                                  [MAX_TOKEN_ID] * self.chunk_tokens))
        if self.header_capacity < need:  # the token ids grow with the chunk as the row does: K/V width decides
            raise ValueError(f"a header row of {self.header_capacity} bytes is too small for the metadata of a "
                             f"{self.chunk_tokens}-token chunk (up to {need} bytes); the K/V width is too small")

    @classmethod
    def of_models(cls, target_cfg, draft_cfg, chunk_tokens: int, dtype: torch.dtype) -> "PackedLayout":
        """The layout of a target (Qwen3Config) and its drafter (DFlashConfig, or None for native).

        A drafter whose K/V heads or head size differ from the target's cannot share one KV_2LTD tensor: refused
        here, when the store is made (the same width split otherwise, say 8 x 128 against 16 x 64, made a store that
        refused every put)."""
        if draft_cfg is not None and (draft_cfg.num_key_value_heads, draft_cfg.head_dim) != \
                (target_cfg.num_key_value_heads, target_cfg.head_dim):
            raise ValueError(f"drafter K/V of {draft_cfg.num_key_value_heads} heads x {draft_cfg.head_dim} != target's "
                             f"{target_cfg.num_key_value_heads} x {target_cfg.head_dim}: the two halves cannot be "
                             "packed into one LMCache object")
        return cls(target_cfg.num_hidden_layers, draft_cfg.num_hidden_layers if draft_cfg is not None else 0,
                   target_cfg.num_key_value_heads, target_cfg.head_dim, chunk_tokens, dtype)

    @property
    def rows(self) -> int:
        return self.target_layers + self.draft_layers + 1

    @property
    def width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def kv_shape(self) -> tuple[int, int, int, int, int]:
        """LMCacheMetadata.kv_shape: (layers, 2, chunk tokens, kv heads, head dim)."""
        return (self.rows, 2, self.chunk_tokens, self.kv_heads, self.head_dim)

    @property
    def object_shape(self) -> torch.Size:
        return torch.Size([2, self.rows, self.chunk_tokens, self.width])

    @property
    def payload_bytes(self) -> int:
        """Bytes of the chunk's tensors (both halves) an object holds."""
        return (self.target_layers + self.draft_layers) * self.header_capacity

    @property
    def header_capacity(self) -> int:
        """Bytes of the header row (its K and V halves together)."""
        return 2 * self.chunk_tokens * self.width * torch.empty((), dtype=self.dtype).element_size()

    def fits(self, chunk: KVChunk) -> str | None:
        """Why the chunk cannot be packed in this layout, or None when it can."""
        kv = (self.chunk_tokens, self.kv_heads, self.head_dim)
        if chunk.num_tokens != self.chunk_tokens:
            return f"{chunk.num_tokens} tokens, the store holds chunks of {self.chunk_tokens}"
        if tuple(chunk.target_kv.shape) != (self.target_layers, 2, *kv):
            return f"target K/V of shape {list(chunk.target_kv.shape)}"
        if (chunk.draft_kv is None) != (self.draft_layers == 0):
            return "drafter half missing" if chunk.draft_kv is None else "a drafter half in a target-only store"
        if chunk.draft_kv is not None and tuple(chunk.draft_kv.shape) != (self.draft_layers, 2, *kv):
            return f"draft K/V of shape {list(chunk.draft_kv.shape)}"
        if chunk.target_kv.dtype != self.dtype or (chunk.draft_kv is not None and chunk.draft_kv.dtype != self.dtype):
            return f"dtype {chunk.target_kv.dtype}, the store holds {self.dtype}"
        n = _FIXED + len(_meta(chunk.key, chunk.parent, chunk.fingerprint, chunk.token_ids))
        if n > self.header_capacity:  # longer keys than flashpd's own: refused here, before LMCache allocates
            return f"chunk metadata of {n} bytes exceeds the header row ({self.header_capacity})"
        return None


def pack(layout: PackedLayout, chunk: KVChunk, out: torch.Tensor, mac: MacKey) -> None:
    """Write chunk into out [2, rows, T, width] (an LMCache memory object's tensor), sealed with mac."""
    why = layout.fits(chunk)
    if why is not None:
        raise ValueError(f"chunk {chunk.key[:16]}... does not fit the store's layout: {why}")
    if tuple(out.shape) != tuple(layout.object_shape) or out.dtype != layout.dtype:
        raise ValueError(f"memory object {list(out.shape)} {out.dtype} is not {list(layout.object_shape)} {layout.dtype}")
    lt, t, w = layout.target_layers, layout.chunk_tokens, layout.width
    out[:, :lt].copy_(chunk.target_kv.permute(1, 0, 2, 3, 4).reshape(2, lt, t, w))
    if chunk.draft_kv is not None:
        out[:, lt:lt + layout.draft_layers].copy_(chunk.draft_kv.permute(1, 0, 2, 3, 4).reshape(2, layout.draft_layers, t, w))
    meta = _meta(chunk.key, chunk.parent, chunk.fingerprint, chunk.token_ids)
    if _FIXED + len(meta) > layout.header_capacity:  # fits() refused it already: not reached from LMCacheStore.put
        raise ValueError(f"chunk metadata of {len(meta)} bytes exceeds the header row ({layout.header_capacity})")
    _write_header(out, _MAGIC + bytes(MAC_BYTES) + struct.pack("<I", len(meta)) + meta)
    _header_rows(out)[0][_TAG].copy_(torch.frombuffer(bytearray(_mac(layout, out, mac)), dtype=torch.uint8))


def unpack(layout: PackedLayout, obj: torch.Tensor, key: str, mac: MacKey,
           reader: ChunkLayout | None = None) -> KVChunk:
    """Verify the object (magic, MAC, header, key; and the reader's layout, if given) and copy the chunk
    out; raises CorruptChunk, or LayoutMismatch for a valid object the reader cannot use."""
    if tuple(obj.shape) != tuple(layout.object_shape) or obj.dtype != layout.dtype:
        raise CorruptChunk(f"LMCache object {list(obj.shape)} {obj.dtype} is not this store's layout")
    head = _read_header(obj, _FIXED)
    if head[:len(_MAGIC)] != _MAGIC:
        raise CorruptChunk("LMCache object has no flashpd header (bad magic or an older format)")
    (n,) = struct.unpack("<I", head[_FIXED - 4:_FIXED])
    if _FIXED + n > layout.header_capacity:
        raise CorruptChunk("LMCache object header length is out of range")
    if not hmac.compare_digest(_mac(layout, obj, mac), head[_TAG]):
        raise CorruptChunk("LMCache object MAC mismatch (corrupt, or not sealed with this cluster's secret)")
    meta = _read_header(obj, _FIXED + n)[_FIXED:]
    try:
        h = json.loads(meta)
    except (ValueError, RecursionError) as e:
        raise CorruptChunk(f"LMCache object header is unreadable ({type(e).__name__})") from None
    if not isinstance(h, dict) or set(h) != {"key", "parent", "fingerprint", "token_ids"}:
        raise CorruptChunk("LMCache object header does not have exactly key, parent, fingerprint, token_ids")
    check_identity(h)
    if len(h["token_ids"]) != layout.chunk_tokens:
        raise CorruptChunk(f"LMCache object header has {len(h['token_ids'])} token ids for {layout.chunk_tokens} rows")
    if h["key"] != key:
        raise CorruptChunk(f"LMCache object holds key {h['key'][:16]}..., asked for {key[:16]}...")
    if reader is not None:
        why = reader.check_header(_as_header(layout, h), layout.payload_bytes)
        if why is not None:
            raise LayoutMismatch(f"chunk {key[:16]}...: {why}")
    lt, ld, t = layout.target_layers, layout.draft_layers, layout.chunk_tokens
    kv = (t, layout.kv_heads, layout.head_dim)
    tk = obj[:, :lt].reshape(2, lt, *kv).permute(1, 0, 2, 3, 4).contiguous()
    dk = obj[:, lt:lt + ld].reshape(2, ld, *kv).permute(1, 0, 2, 3, 4).contiguous() if ld else None
    return KVChunk(h["key"], h["parent"], h["fingerprint"], h["token_ids"], tk, dk)


def _meta(key: str, parent: str, fingerprint: str, token_ids: list[int]) -> bytes:
    """The JSON metadata a header row holds (what pack writes and fits / the layout size)."""
    return json.dumps({"key": key, "parent": parent, "fingerprint": fingerprint,
                       "token_ids": [int(t) for t in token_ids]}).encode()


def _as_header(layout: PackedLayout, h: dict) -> dict:
    """The chunk header an object of this store stands for (what a reader's ChunkLayout checks)."""
    kv = [layout.chunk_tokens, layout.kv_heads, layout.head_dim]
    return {**h, "dtype": dtype_name(layout.dtype), "target_shape": [layout.target_layers, 2, *kv],
            "draft_shape": [layout.draft_layers, 2, *kv] if layout.draft_layers else None}


def _mac(layout: PackedLayout, obj: torch.Tensor, mac: MacKey) -> bytes:
    """Keyed BLAKE3 over every byte of the object (both halves' K/V rows and the whole header row,
    padding included) except the MAC field itself. Reads memory in place, copies nothing."""
    h = mac.hasher()
    body = layout.rows - 1
    for kv in (0, 1):  # obj[kv, :body] is one contiguous run of memory
        h.update(_bytes(obj[kv, :body]))
    k, v = (_bytes(r) for r in _header_rows(obj))
    h.update(k[:_TAG.start])
    h.update(k[_TAG.stop:])
    h.update(v)
    return h.digest(MAC_BYTES)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _header_rows(obj: torch.Tensor) -> list[torch.Tensor]:
    """The header row's K and V halves as flat byte views (writes go into the object)."""
    return [obj[kv, -1].view(torch.uint8).view(-1) for kv in (0, 1)]


def _write_header(obj: torch.Tensor, blob: bytes) -> None:
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    off = 0
    for row in _header_rows(obj):
        n = min(row.numel(), data.numel() - off)
        row[:n].copy_(data[off:off + n])
        row[n:].zero_()
        off += n


def _read_header(obj: torch.Tensor, nbytes: int) -> bytes:
    """The first nbytes of the header row (K half, then V half)."""
    out = []
    for row in _header_rows(obj):
        take = min(row.numel(), nbytes - sum(len(b) for b in out))
        out.append(row[:take].numpy().tobytes())
    return b"".join(out)

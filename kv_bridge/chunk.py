"""One cache entry: a chunk of positions with BOTH halves of the method's state.

target_kv [target_layers, 2, T, kv_heads, head_dim] and, for DFlash, draft_kv [draft_layers, 2, T,
kv_heads, head_dim] (the drafter's context K/V for the same positions, moved as is: bit-exact,
no recompute). They are serialized, authenticated, stored, moved and evicted as one unit.

Bytes from outside are untrusted: a reader checks the keyed MAC first (nothing is parsed from
bytes that do not authenticate), then the header against a strict schema, then that the header's
shapes account for exactly the bytes present, and (given a ChunkLayout) that the chunk is one
this reader can use, all before a tensor is built. Every failure is a CorruptChunk (or a
LayoutMismatch for an authentic chunk that does not fit), never a KeyError or TypeError.
"""
from __future__ import annotations

import hmac
import json
import struct
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashpd.kv_bridge.auth import MAC_BYTES, MacKey
from flashpd.kv_bridge.layout import DTYPES, ITEM_BYTES, ChunkLayout, dtype_name, numel

MAGIC = b"FPKV"
FORMAT_VERSION = 2  # 1: XXH3-128 checksum, no version field; 2: keyed BLAKE3 MAC
PREFIX = struct.Struct("<4sII")  # magic, format version, header length
HEADER_FIELDS = frozenset({"key", "parent", "fingerprint", "token_ids", "dtype", "target_shape", "draft_shape"})
MAX_TOKEN_ID = 2**32 - 1


class CorruptChunk(ValueError):
    """Bytes that are not a valid chunk (bad magic or format, MAC mismatch, bad header, wrong length):
    never used."""


class LayoutMismatch(ValueError):
    """An authentic, well-formed chunk that is not what this reader can use (another geometry, dtype,
    token count or method): a miss for this reader; the entry itself is left alone."""


@dataclass(frozen=True)
class Lease:
    """How long a chunk's bytes, read in place from a bridge's arena, are still its own: until `expires_at`
    (time.monotonic, the reader's own clock) and while the slot's generation word (`word`, a one-element uint32
    view of the arena) still reads `value` (the bridge bumps it before the slot can be reused). Either alone would
    do in the common case; the clock bounds a reader that outlives the hold, the word one whose handle waited in a
    buffer longer than the margin."""

    expires_at: float
    word: Any = None
    value: int = 0

    def valid(self) -> bool:
        return time.monotonic() < self.expires_at and (self.word is None or int(self.word[0]) == self.value)


@dataclass
class KVChunk:
    key: str
    parent: str  # the previous chunk's key ("" for the first chunk)
    fingerprint: str
    token_ids: list[int]
    target_kv: torch.Tensor
    draft_kv: torch.Tensor | None
    # the tensors view a bridge's shared arena (arena.py), whose slot may be reused: whoever copies them out checks
    # fresh() afterwards, and does not use the copy when it is False
    lease: "Lease | None" = None

    def fresh(self) -> bool:
        """Whether the bytes read so far are still the chunk's (always, for a chunk that owns them)."""
        return self.lease is None or self.lease.valid()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def nbytes(self) -> int:
        n = self.target_kv.numel() * self.target_kv.element_size()
        return n + (self.draft_kv.numel() * self.draft_kv.element_size() if self.draft_kv is not None else 0)

    def to_bytes(self, mac: MacKey) -> bytes:
        """Layout: magic, u32 format, u32 header length, JSON header, target bytes, draft bytes, then a
        32-byte keyed BLAKE3 MAC over everything before it."""
        return b"".join(self.to_parts(mac))

    def to_view(self, mac: MacKey) -> memoryview:
        """to_bytes' bytes in fresh memory of their own, as a read-only view (join_parts): what a store that keeps
        entries as immutable bytes takes."""
        return join_parts(self.to_parts(mac))

    def to_parts(self, mac: MacKey) -> list[bytes | memoryview]:
        """to_bytes' pieces in order, the tensors' bytes not copied (a same-host writer puts them
        straight into a segment: one copy of the chunk less); b"".join(parts) == to_bytes(mac)."""
        parts = self.body_parts()
        return parts + [mac.tag(parts)]  # the tensors hashed in place; the caller copies them once

    def body_parts(self) -> list[bytes | memoryview]:
        """to_parts without the MAC: a streaming writer hashes them as it sends them (StreamingMac)
        instead of in a pass of their own before the first byte leaves."""
        tk = _host(self.target_kv)
        dk = _host(self.draft_kv) if self.draft_kv is not None else None
        dt = dtype_name(tk.dtype)
        if dt not in DTYPES or (dk is not None and dk.dtype != tk.dtype):
            raise ValueError(f"chunk {self.key[:16]}...: K/V dtypes {tk.dtype} / {None if dk is None else dk.dtype} "
                             f"cannot be serialized; both halves must be one dtype of {sorted(DTYPES)}")
        header = {"key": self.key, "parent": self.parent, "fingerprint": self.fingerprint,
                  "token_ids": [int(t) for t in self.token_ids], "dtype": dt,
                  "target_shape": list(tk.shape), "draft_shape": list(dk.shape) if dk is not None else None}
        hb = json.dumps(header, separators=(",", ":")).encode()
        return [PREFIX.pack(MAGIC, FORMAT_VERSION, len(hb)), hb, _raw(tk)] + ([_raw(dk)] if dk is not None else [])

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, mac: MacKey, own: bool = False,
                   layout: ChunkLayout | None = None, key: str | None = None,
                   body_mac: bytes | None = None, share: bool = False) -> "KVChunk":
        """Verify (see verify_bytes) and build the tensors. own: the caller hands over a writable buffer
        nobody else holds (a segment just taken, a stream just assembled), and the tensors are views of
        it instead of copies: one copy of the chunk less on the import path. share: `data` is immutable (a
        memory store's entry: bytes, or a read-only view handed over to it) and the caller only reads the
        tensors (a restore copies them into its caches): they are views of it too, read-only by that contract
        (torch has no read-only tensors; a write would change what every other sharing reader sees). A copy
        into a fresh buffer cost more than the rest of a memory-store hit (its page faults: docs/results.md).
        Otherwise the tensors are copies. body_mac: see verify_bytes."""
        h, offsets = verify_bytes(data, mac, layout, key, body_mac)
        body = memoryview(data)[:-MAC_BYTES]
        alias = not body.readonly if own else share and body.readonly
        dtype = DTYPES[h["dtype"]]
        tk = _tensor(body, offsets[0], h["target_shape"], dtype, alias)
        dk = _tensor(body, offsets[1], h["draft_shape"], dtype, alias) if h["draft_shape"] is not None else None
        return cls(h["key"], h["parent"], h["fingerprint"], h["token_ids"], tk, dk)


def verify_bytes(data: bytes | bytearray | memoryview, mac: MacKey, layout: ChunkLayout | None = None,
                 key: str | None = None, body_mac: bytes | None = None) -> tuple[dict, tuple[int, int]]:
    """Check format, MAC, header schema, lengths, the key the bytes are filed under and the layout
    (each when given) without building tensors.

    body_mac: the MAC of exactly these bytes' body, computed by a StreamingMac as they arrived (a
    receiver that hashed each frame while it was in cache): compared with the chunk's tag instead of
    hashing the body again. Every other check is the same, in the same order.

    Returns the header and the byte offsets of the target and draft tensors. Raises CorruptChunk, or
    LayoutMismatch for a valid chunk that does not fit `layout`."""
    data = memoryview(data).cast("B")
    if len(data) < PREFIX.size + MAC_BYTES:
        raise CorruptChunk("not a flashpd KV chunk (too short)")
    magic, version, hl = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptChunk("not a flashpd KV chunk (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"chunk format {version}; this reader reads format {FORMAT_VERSION}")
    body = data[:-MAC_BYTES]
    if hl > len(body) - PREFIX.size:
        raise CorruptChunk("chunk header length runs past the chunk")
    authentic = mac.verify([body], data[-MAC_BYTES:]) if body_mac is None \
        else hmac.compare_digest(body_mac, bytes(data[-MAC_BYTES:]))
    if not authentic:
        raise CorruptChunk("chunk MAC mismatch (corrupt, or not made with this cluster's secret)")
    h = parse_header(body[PREFIX.size:PREFIX.size + hl])
    item = ITEM_BYTES[h["dtype"]]
    t_off = PREFIX.size + hl
    d_off = t_off + numel(h["target_shape"]) * item
    end = d_off + (numel(h["draft_shape"]) * item if h["draft_shape"] is not None else 0)
    if end != len(body):
        raise CorruptChunk("chunk length does not match its header")
    if key is not None and h["key"] != key:  # a valid chunk filed under another key is corrupt too
        raise CorruptChunk(f"chunk header names key {h['key'][:16]}..., filed under {key[:16]}...")
    if layout is not None:
        why = layout.check_header(h, end - t_off)
        if why is not None:
            raise LayoutMismatch(f"chunk {h['key'][:16]}...: {why}")
    return h, (t_off, d_off)


class StreamingMac:
    """A chunk's MAC computed while its bytes pass in order (frames arriving or leaving), so that
    sealing or verifying a streamed chunk costs no second pass over it, and each piece is hashed
    while it is still in cache. Feed every byte of the chunk, in order, trailing tag included (the
    tag is not hashed): `total` says where the body ends."""

    __slots__ = ("_hasher", "_left")

    def __init__(self, mac: MacKey, total: int) -> None:
        self._hasher = mac.hasher(max_threads=1)  # frames of parallel streams: the streams are the threads
        self._left = total - MAC_BYTES  # body bytes still to hash (a chunk this short fails verify_bytes)

    @property
    def body_done(self) -> bool:
        """Every body byte was fed: digest() is final."""
        return self._left <= 0

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        n = len(piece)
        if self._left > 0:
            take = min(n, self._left)
            self._hasher.update(piece if take == n else memoryview(piece)[:take])
            self._left -= take

    def digest(self) -> bytes:
        return self._hasher.digest(MAC_BYTES)


def peek_parent(data: bytes | bytearray | memoryview) -> str | None:
    """The parent key a chunk's header names, read without verifying anything (for bytes verified elsewhere, or
    about to be): None when the bytes do not hold a readable header."""
    data = memoryview(data).cast("B")
    if len(data) < PREFIX.size:
        return None
    magic, _, hl = PREFIX.unpack_from(data)
    if magic != MAGIC or hl > len(data) - PREFIX.size:
        return None
    try:
        parent = json.loads(bytes(data[PREFIX.size:PREFIX.size + hl])).get("parent")
    except (ValueError, AttributeError, RecursionError):
        return None
    return parent if isinstance(parent, str) else None


def parse_header(raw: bytes | memoryview) -> dict:
    """The JSON header, held to the schema: exactly HEADER_FIELDS; key/parent/fingerprint strings
    (key non-empty); token_ids a list of ints in [0, 2**32); dtype a known name; target_shape 5
    non-negative ints [layers, 2, T, kv_heads, head_dim] with T = len(token_ids); draft_shape None or
    the same. bool, float, str and nested values are refused."""
    try:
        h = json.loads(bytes(raw))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, over-long ints, deep nesting
        raise CorruptChunk(f"chunk header is not JSON ({type(e).__name__})") from None
    if not isinstance(h, dict) or set(h) != HEADER_FIELDS:
        raise CorruptChunk(f"chunk header must have exactly the fields {sorted(HEADER_FIELDS)}")
    check_identity(h)
    if type(h["dtype"]) is not str or h["dtype"] not in DTYPES:
        raise CorruptChunk(f"chunk header dtype is not one of {sorted(DTYPES)}")
    n = len(h["token_ids"])
    _check_shape(h["target_shape"], "target_shape", n)
    if h["draft_shape"] is not None:
        _check_shape(h["draft_shape"], "draft_shape", n)
    return h


def check_identity(h: dict) -> None:
    """key, parent, fingerprint and token_ids of a header (shared with the LMCache object header)."""
    for name in ("key", "parent", "fingerprint"):
        if type(h.get(name)) is not str:
            raise CorruptChunk(f"chunk header {name} is not a string")
    if not h["key"]:
        raise CorruptChunk("chunk header key is empty")
    ids = h.get("token_ids")
    if type(ids) is not list or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise CorruptChunk("chunk header token_ids is not a list of token ids")


MAX_DIM = 1 << 31  # past any real layout; a chunk of no bytes with larger dims passed, and torch could not stride it


def _check_shape(shape: object, name: str, n_tokens: int) -> None:
    if type(shape) is not list or len(shape) != 5 or not all(type(d) is int and 0 <= d < MAX_DIM for d in shape):
        raise CorruptChunk(f"chunk header {name} is not 5 integers in [0, 2**31)")
    if shape[1] != 2 or shape[2] != n_tokens:
        raise CorruptChunk(f"chunk header {name} is not [layers, 2, {n_tokens} tokens, kv_heads, head_dim]")


def max_chunk_bytes(layout: ChunkLayout) -> int:
    """The largest serialized chunk of this layout: its tensors, a generous header (token ids of up to
    10 digits, three 64-character keys), the fixed prefix and the MAC. What a bridge accepts at most."""
    header = 4096 + 12 * layout.chunk_tokens
    return PREFIX.size + header + layout.payload_bytes() + MAC_BYTES


def join_parts(parts: list[bytes | memoryview]) -> memoryview:
    """The parts' concatenation in fresh numpy memory, read-only. numpy asks the kernel for huge pages for a large
    buffer (madvise), so filling it faults 2 MiB at a time; b"".join's fresh 4 KiB pages took 3-4x as long for a
    43 MB chunk, and were most of a publish into a memory store on a GPU host (docs/results.md)."""
    views = [memoryview(p).cast("B") for p in parts]
    out = np.empty(sum(len(v) for v in views), dtype=np.uint8)
    off = 0
    for v in views:
        out[off:off + len(v)] = np.frombuffer(v, dtype=np.uint8)
        off += len(v)
    return memoryview(out).toreadonly()


def _host(t: torch.Tensor) -> torch.Tensor:
    """t's values, contiguous, on the CPU. Off a GPU they are copied into page-locked memory from torch's caching
    host allocator (a chunk's block goes back to it when the last view of its bytes is gone, and the next chunk of
    the same size takes it): a pageable copy into fresh memory is the driver's staged path plus a page fault a page
    (docs/results.md, the publish path)."""
    t = t.detach()
    if t.device.type != "cuda":
        return t.contiguous().cpu()
    try:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    except RuntimeError:  # no page-locked memory to be had (a locked-memory limit): the pageable copy, slower
        return t.contiguous().cpu()
    out.copy_(t)  # blocking: the bytes are there when it returns
    return out


def _raw(t: torch.Tensor) -> memoryview | bytes:
    """The tensor's bytes without copying (t is contiguous and on the CPU)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else b""


def _tensor(body: memoryview, off: int, shape: list[int], dtype: torch.dtype, alias: bool = False) -> torch.Tensor:
    nb = numel(shape) * ITEM_BYTES[dtype_name(dtype)]
    if nb == 0:
        return torch.empty(shape, dtype=dtype)
    buf = body[off:off + nb] if alias else bytearray(body[off:off + nb])
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


# from_bytes(share=True) aliases immutable bytes on purpose; torch warns (once) that such a tensor is not read-only
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

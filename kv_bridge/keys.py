"""Cache keys: chained hashes over fixed-size token chunks, salted with the method fingerprint.

A chunk's key commits to every token before it (through its parent's key) and to the METHOD that
produced its state: target weights, drafter weights, tapped layers, dtype and KV layout version.
Two methods never share a key, so a target-only entry can never be mistaken for a full one.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

LAYOUT_VERSION = 3  # bump when a chunk's byte layout changes (3: keyed BLAKE3 MAC, chunk format 2)


@dataclass(frozen=True)
class MethodFingerprint:
    target: str  # identity of the target weights (weights_identity)
    drafter: str  # identity of the drafter weights, or "none" (native: target KV only)
    target_layer_ids: tuple[int, ...]
    dtype: str
    layout_version: int = LAYOUT_VERSION

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def weights_identity(model_dir: str | Path, samples: int = 64, window: int = 1 << 16) -> str:
    """A content identity of a checkpoint directory without reading every byte of a 16 GB model:
    config.json, each safetensors header (names, shapes, offsets) and `samples` windows of
    `window` bytes spread over each weight file."""
    h = hashlib.sha256()
    d = Path(model_dir)
    h.update((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(n))
            for i in range(samples):
                fh.seek(int(size * i / samples))
                h.update(fh.read(window))
    return h.hexdigest()


def chunk_keys(token_ids: list[int], chunk_tokens: int, fingerprint: str) -> list[str]:
    """Keys of the FULL chunks of token_ids (a trailing partial chunk has no key)."""
    keys: list[str] = []
    parent = fingerprint
    arr = np.asarray(token_ids, dtype=np.int64)
    for i in range(len(token_ids) // chunk_tokens):
        h = hashlib.sha256(parent.encode())
        h.update(arr[i * chunk_tokens:(i + 1) * chunk_tokens].tobytes())
        parent = h.hexdigest()
        keys.append(parent)
    return keys

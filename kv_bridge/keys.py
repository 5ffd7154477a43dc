"""Cache keys: chained hashes over fixed-size token chunks, salted with the method fingerprint.

A chunk's key commits to every token before it (through its parent's key) and to the METHOD that
produced its state: target weights, drafter weights and their format, tapped layers, dtype and KV layout
version.
Two methods never share a key, so a target-only entry can never be mistaken for a full one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3
import numpy as np

log = logging.getLogger(__name__)

LAYOUT_VERSION = 3  # bump when a chunk's byte layout changes (3: keyed BLAKE3 MAC, chunk format 2)


@dataclass(frozen=True)
class MethodFingerprint:
    target: str  # identity of the target weights (weights_identity)
    drafter: str  # identity of the drafter weights, or "none" (native: target KV only)
    target_layer_ids: tuple[int, ...]
    dtype: str
    layout_version: int = LAYOUT_VERSION
    # the drafter's weight format (DFlashDrafter.quantize): its context K/V take fc's fp8 values under "fp8", so
    # the two formats' entries differ and must not be shared
    draft_quantization: str = "none"

    def digest(self) -> str:
        d = asdict(self)
        if d["draft_quantization"] == "none":  # the digest a fingerprint had before the field: old entries still hit
            del d["draft_quantization"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


# directory -> (its files' stamps, identity): one hash a process, and one entry a directory (a directory whose files
# changed is hashed again and replaces its entry; the old stamps can never be asked for again)
_IDENTITIES: dict[str, tuple[tuple, str]] = {}
_IDENTITIES_LOCK = threading.Lock()


def weights_identity(model_dir: str | Path) -> str:
    """A content identity of a checkpoint directory: config.json and every byte of each weight file the loader reads.

    Exactly the loader's files (engine/loader.safetensors_files: the shards model.safetensors.index.json names,
    wherever they are, else model.safetensors, else *.safetensors), each under its path relative to the directory:
    a shard the identity does not hash could differ between two checkpoints that would then share keys, and one's
    cache entries be restored as the other's. Every byte, because a sampled identity lets a checkpoint changed
    between its samples (a drafter fine-tuned in part) share keys with the one before it. BLAKE3 over a memory map on
    all cores: a 16 GB model hashes in about the time one read of it takes (the loader's read finds it in the page
    cache). Kept per process, keyed by each file's size, mtime, ctime and inode: ctime because a file rewritten in
    place can keep its size, inode and mtime (cp -p, tar -x and rsync -t set mtimes), while any change of a file's
    bytes or stamps moves its ctime, which no caller can set."""
    from flashpd.engine.loader import safetensors_files  # noqa: PLC0415  (torch: only where identities are made)

    d = Path(model_dir).resolve()
    files = [d / "config.json", *safetensors_files(d)]
    names = [os.path.relpath(f, d) for f in files]
    stamps = tuple((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                   for name, f in zip(names, files) for st in (f.stat(),))
    with _IDENTITIES_LOCK:
        held = _IDENTITIES.get(str(d))
    if held is not None and held[0] == stamps:
        return held[1]
    t0 = time.perf_counter()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    total = 0
    for f, (name, size, *_) in zip(files, stamps):
        raw = name.encode()  # a top-level file's name as before: identities of plain checkpoints are unchanged
        h.update(len(raw).to_bytes(8, "little") + raw + size.to_bytes(8, "little"))
        if size == 0:
            continue
        with f.open("rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mm:
            h.update(mm)
        total += size
    digest = h.hexdigest()
    log.info("weights identity of %s: %.2f GB hashed in %.1f s", d.name, total / 1e9, time.perf_counter() - t0)
    with _IDENTITIES_LOCK:
        _IDENTITIES[str(d)] = (stamps, digest)
    return digest


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

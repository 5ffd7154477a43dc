"""Cache keys: chained hashes over fixed-size token chunks, salted with the method fingerprint.

A chunk's key commits to every token before it (through its parent's key) and to the METHOD that
produced its state: target weights, drafter weights and their format, tapped layers, dtype, the KV layout
version and the version of the code that computes the values (KV_VERSION).
Two methods never share a key, so a target-only entry can never be mistaken for a full one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3
import numpy as np

log = logging.getLogger(__name__)

LAYOUT_VERSION = 3  # bump when a chunk's byte layout changes (3: keyed BLAKE3 MAC, chunk format 2)
# bump when the code that computes a chunk's values changes them at one layout (2: an fp8 drafter's context K/V take
# fc's fp8 values, and keys bind the draft format; entries written before, on a disk tier or a long-lived store,
# were keyed as bf16 ones): a store's older entries are then never read, only recomputed and replaced
KV_VERSION = 2


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
    kv_version: int = KV_VERSION

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


# directory -> (its files' stamps, identity): one hash a process, and one entry a directory (a directory whose files
# changed is hashed again and replaces its entry; the old stamps can never be asked for again)
_IDENTITIES: dict[str, tuple[tuple, str]] = {}
_IDENTITIES_LOCK = threading.Lock()


def weights_identity(model_dir: str | Path, loaded: tuple | None = None) -> str:
    """A content identity of a checkpoint directory: config.json and every byte of each weight file the loader reads.

    Exactly the loader's files (engine/loader.safetensors_files: the shards model.safetensors.index.json names,
    wherever they are, else model.safetensors, else *.safetensors), each under its path relative to the directory:
    a shard the identity does not hash could differ between two checkpoints that would then share keys, and one's
    cache entries be restored as the other's. Every byte, because a sampled identity lets a checkpoint changed
    between its samples (a drafter fine-tuned in part) share keys with the one before it. BLAKE3 over a memory map on
    all cores: a 16 GB model hashes in about the time one read of it takes (the loader's read finds it in the page
    cache). Kept per process, keyed by the files' stamps (loader.checkpoint_stamps).

    `loaded`: the stamps the process's weights were loaded at (EngineParts.target_stamps). The identity is of those
    files or refused: a checkpoint rewritten after the load would otherwise key this process's KV to weights it does
    not hold, and every worker loading the new files would restore that KV as theirs."""
    from flashpd.engine.config import CheckpointError  # noqa: PLC0415  (torch: only where identities are made)
    from flashpd.engine.loader import checkpoint_stamps  # noqa: PLC0415

    d = Path(model_dir).resolve()
    stamps = checkpoint_stamps(d)
    if loaded is not None and stamps != loaded:
        raise CheckpointError(f"{d}: the checkpoint's files changed after this process loaded them; its KV cannot be "
                              f"keyed to them (restart the worker to serve the new weights)")
    with _IDENTITIES_LOCK:
        held = _IDENTITIES.get(str(d))
    if held is not None and held[0] == stamps:
        return held[1]
    t0 = time.perf_counter()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    total = 0
    try:
        for name, size, *_ in stamps:
            raw = name.encode()  # a top-level file's name as before: identities of plain checkpoints are unchanged
            h.update(len(raw).to_bytes(8, "little") + raw + size.to_bytes(8, "little"))
            if size == 0:
                continue
            with (d / name).open("rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mm:
                h.update(mm)
            total += size
    except (OSError, ValueError):  # a file removed or cut short since its stat (mmap past its end)
        stamps = ()
    if checkpoint_stamps(d) != stamps:  # bytes of two versions were hashed
        raise CheckpointError(f"{d}: the checkpoint's files changed while they were hashed; start again once they "
                              f"are completely written")
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

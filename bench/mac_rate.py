"""How fast the chunk MAC (keyed BLAKE3, kv_bridge/auth.py) runs on this machine, in GB/s.

    python -m flashpd.bench.mac_rate [--mib 512] [--chunk-tokens 256] [--reps 3] [--out FILE]

Every chunk is MACed once when it is made and verified by each reader (the bridge on Put and
again on Get, the importing worker), so this rate bounds the bridge. Measured with max_threads
AUTO (what the bridge uses) and with one thread, over --mib of data, hashed (a) as one buffer and
(b) as whole chunks at Qwen3-8B + DFlash-drafter shapes (KVChunk.to_bytes and verify_bytes, the
real path). Reports the best of --reps runs. GB/s = bytes hashed / seconds (1 GB = 1e9 B).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import blake3
import torch

from flashpd.bench.common import machine, write_json
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.chunk import KVChunk, verify_bytes

# Qwen3-8B target (36 layers, 8 kv heads x 128) and its DFlash drafter (5 layers), bf16
TARGET_LAYERS, DRAFT_LAYERS, KV_HEADS, HEAD_DIM = 36, 5, 8, 128


def _best_gbps(fn, nbytes: int, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def raw_rate(key: bytes, buf: memoryview, threads: int, reps: int) -> float:
    def run() -> None:
        h = blake3.blake3(key=key, max_threads=threads)
        h.update(buf)
        h.digest()

    return _best_gbps(run, len(buf), reps)


def chunk_rates(total: int, chunk_tokens: int, reps: int) -> dict:
    """Seal (to_bytes) and verify (verify_bytes) of real chunks: the MAC plus what surrounds it."""
    mac = ClusterSecret.generate().mac_key
    g = torch.Generator().manual_seed(0)
    t = chunk_tokens

    def one(i: int) -> KVChunk:
        tk = torch.randn(TARGET_LAYERS, 2, t, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
        dk = torch.randn(DRAFT_LAYERS, 2, t, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
        return KVChunk(f"bench-{i}", "", "bench", list(range(t)), tk, dk)

    size = one(0).nbytes()
    chunks = [one(i) for i in range(max(1, total // size))]
    blobs = [c.to_bytes(mac) for c in chunks]
    nbytes = sum(len(b) for b in blobs)
    seal = _best_gbps(lambda: [c.to_parts(mac) for c in chunks], nbytes, reps)
    verify = _best_gbps(lambda: [verify_bytes(b, mac) for b in blobs], nbytes, reps)
    return {"chunk_tokens": t, "chunk_bytes": len(blobs[0]), "chunks": len(blobs), "seal_gbps": round(seal, 3),
            "verify_gbps": round(verify, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="data hashed per measurement")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    total = a.mib << 20
    buf = memoryview(os.urandom(total))
    key = os.urandom(32)
    result = {
        "bench": "mac_rate", "mac": "keyed BLAKE3 (blake3 %s)" % blake3.__version__, "bytes": total,
        "cpus": os.cpu_count(), "machine": machine(),
        "buffer_gbps": {"auto_threads": round(raw_rate(key, buf, blake3.blake3.AUTO, a.reps), 3),
                        "one_thread": round(raw_rate(key, buf, 1, a.reps), 3)},
        "chunks_auto_threads": chunk_rates(total, a.chunk_tokens, a.reps),
    }
    print(json.dumps(result, indent=2))
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

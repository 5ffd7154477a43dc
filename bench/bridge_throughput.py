"""KV bridge loopback throughput (GB/s) at Qwen3-8B + DFlash-drafter KV shapes.

    python -m flashpd.bench.bridge_throughput --out bench/results/bridge_throughput_cpu.json

Per token a chunk carries the target's K/V (36 layers x 2 x 8 kv heads x 128 dim bf16 = 147,456 B)
and the drafter's (5 layers x 2 x 8 x 128 bf16 = 20,480 B): 167,936 B/token. For each chunk size
(tokens per chunk), frame size, transport (INLINE frames or same-host SHM handles) and number of
parallel client streams, the client Puts `--total-mib` of chunks, then Gets them back, through
the public BridgeClient API (serialize + MAC on one side, reassemble + verify on the other).
The server runs in its own process (its own GIL), as a bridge beside an engine would.
GB/s = serialized chunk bytes moved / wall time of the whole phase (1 GB = 1e9 B).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import subprocess
import sys
import threading
import time
import uuid

import torch

from flashpd.bench.common import write_json
from flashpd.kv_bridge.chunk import KVChunk
from flashpd.kv_bridge.auth import process_secret
from flashpd.kv_bridge.client import BridgeClient

TARGET_LAYERS, DRAFT_LAYERS, KV_HEADS, HEAD_DIM = 36, 5, 8, 128
BYTES_PER_TOKEN = (TARGET_LAYERS + DRAFT_LAYERS) * 2 * KV_HEADS * HEAD_DIM * 2  # 167,936


def make_chunks(tokens: int, count: int) -> list[KVChunk]:
    """`count` chunks of one random K/V payload under distinct keys (content does not change the cost)."""
    g = torch.Generator().manual_seed(tokens)
    tk = torch.randn(TARGET_LAYERS, 2, tokens, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    dk = torch.randn(DRAFT_LAYERS, 2, tokens, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    tag = uuid.uuid4().hex[:12]
    return [KVChunk(f"bench-{tag}-{tokens}-{i}", "", "bench", list(range(tokens)), tk, dk) for i in range(count)]


def start_server(memory_bytes: int) -> tuple[subprocess.Popen, str]:
    # the bridge shares this process's cluster secret, so the default clients here may use it
    proc = subprocess.Popen([sys.executable, "-m", "flashpd.kv_bridge.server", "--memory-bytes", str(memory_bytes)],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, **process_secret().child_env()))
    line = proc.stdout.readline().strip()  # "PORT n", printed once the server listens
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"bridge server did not start: {line!r}")
    return proc, f"127.0.0.1:{line.split()[1]}"


def parallel(fn, shares: list, timeout_s: float) -> float:
    """Run fn(i, share) on one thread per share from a common start; returns the wall seconds."""
    barrier = threading.Barrier(len(shares) + 1, timeout=timeout_s)
    errors: list[BaseException] = []

    def run(i: int, share) -> None:
        barrier.wait()
        try:
            fn(i, share)
        except BaseException as e:  # noqa: BLE001 - reported after the join
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(shares)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout_s)
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a bench stream did not finish in time")
    return wall


def run_config(address: str, tokens: int, frame_bytes: int, transport: str, streams: int, total_bytes: int,
               timeout_s: float) -> dict:
    chunk_bytes = len(make_chunks(tokens, 1)[0].to_bytes(process_secret().mac_key))
    count = max(streams, round(total_bytes / chunk_bytes))
    chunks = make_chunks(tokens, count)
    shares = [chunks[i::streams] for i in range(streams)]
    clients = [BridgeClient(address, timeout_s=timeout_s, frame_bytes=frame_bytes) for _ in range(streams)]
    try:
        for c in clients:
            c.health()  # connect before timing
        put_s = parallel(lambda i, share: _check_put(clients[i].put(share, transport=transport), len(share)),
                         shares, timeout_s)
        got = [0] * streams

        def get(i: int, share: list[KVChunk]) -> None:
            got[i] = len(clients[i].get([c.key for c in share], transport=transport))

        get_s = parallel(get, shares, timeout_s)
        if sum(got) != count:
            raise RuntimeError(f"got {sum(got)} of {count} chunks back (store budget too small?)")
    finally:
        for c in clients:
            c.close()
    moved = count * chunk_bytes
    return {"transport": transport, "chunk_tokens": tokens, "chunk_bytes": chunk_bytes,
            "frame_bytes": frame_bytes if transport == "inline" else None, "streams": streams, "chunks": count,
            "bytes_moved": moved, "put_s": put_s, "get_s": get_s,
            "put_gb_per_s": moved / put_s / 1e9, "get_gb_per_s": moved / get_s / 1e9,
            "put_tokens_per_s": count * tokens / put_s, "get_tokens_per_s": count * tokens / get_s}


def _check_put(summary, n: int) -> None:
    if summary.stored + summary.duplicates != n:
        raise RuntimeError(f"put stored {summary.stored} of {n}: {summary}")


def reference_rates(nbytes: int = 64 << 20) -> dict:
    """What one core does to the same bytes: blake2b (the chunk checksum) and a memcpy."""
    data = os.urandom(nbytes)
    t = time.perf_counter()
    hashlib.blake2b(data, digest_size=32).digest()
    h = time.perf_counter() - t
    t = time.perf_counter()
    bytearray(data)
    c = time.perf_counter() - t
    return {"blake2b_gb_per_s": nbytes / h / 1e9, "memcpy_gb_per_s": nbytes / c / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="KV bridge loopback throughput")
    ap.add_argument("--chunk-tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--frame-mib", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    ap.add_argument("--transports", nargs="+", default=["inline", "shm"], choices=["inline", "shm"])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--total-mib", type=int, default=256, help="chunk bytes moved per config and direction")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default="bench/results/bridge_throughput_cpu.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    total = args.total_mib << 20
    load_before = os.getloadavg()  # other work on the same cores skews every number: recorded
    proc, address = start_server(memory_bytes=4 * total + (256 << 20))
    rows = []
    try:
        run_config(address, 16, 1 << 20, "inline", 1, 8 << 20, args.timeout_s)  # warm-up
        for transport in args.transports:
            frames = [int(f * (1 << 20)) for f in args.frame_mib] if transport == "inline" else [1 << 20]
            for tokens in args.chunk_tokens:
                for frame in frames:
                    for streams in args.streams:
                        r = run_config(address, tokens, frame, transport, streams, total, args.timeout_s)
                        rows.append(r)
                        fb = "-" if r["frame_bytes"] is None else f"{r['frame_bytes'] / (1 << 20):g}"
                        print(f"{transport:6s} tokens={tokens:4d} chunk={r['chunk_bytes'] / (1 << 20):6.2f}MiB "
                              f"frame={fb:>4s}MiB streams={streams} put={r['put_gb_per_s']:.3f} GB/s "
                              f"get={r['get_gb_per_s']:.3f} GB/s", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    ref = reference_rates()
    cmd = "python -m flashpd.bench.bridge_throughput " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    path = write_json(args.out, {"command": cmd, "bytes_per_token": BYTES_PER_TOKEN, "total_bytes_per_config": total,
                                 "cpu_cores": os.cpu_count(), "loadavg_before": load_before,
                                 "loadavg_after": os.getloadavg(), "reference_single_core": ref, "results": rows})
    print(f"single core: blake2b {ref['blake2b_gb_per_s']:.2f} GB/s, memcpy {ref['memcpy_gb_per_s']:.2f} GB/s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KV bridge loopback throughput (GB/s) at Qwen3-8B + DFlash-drafter KV shapes.

    python -m flashpd.bench.bridge_throughput --out bench/results/bridge_throughput_cpu.json

Per token a chunk carries the target's K/V (36 layers x 2 x 8 kv heads x 128 dim bf16 = 147,456 B)
and the drafter's (5 layers x 2 x 8 x 128 bf16 = 20,480 B): 167,936 B/token. For each chunk size
(tokens per chunk), frame size, transport (INLINE frames or same-host SHM handles) and number of
parallel streams, one BridgeClient(streams=N) Puts `--total-mib` of chunks in one call, then Gets
them back in one call (a prefix moved as one transfer), through the public API (serialize + MAC on
one side, reassemble + verify on the other). The server runs in its own process (its own GIL), as a
bridge beside an engine would. GB/s = serialized chunk bytes moved / wall time of the whole phase
(1 GB = 1e9 B). The CPU seconds each process spent per GB moved are recorded too: on a machine with
few cores, or busy with other work, they say more about the byte path than the wall time does.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
import uuid

import blake3
import torch

from flashpd.bench.common import write_json
from flashpd.kv_bridge.chunk import KVChunk
from flashpd.kv_bridge.auth import process_secret
from flashpd.kv_bridge.client import BridgeClient
from flashpd.kv_bridge import shm_pool

TARGET_LAYERS, DRAFT_LAYERS, KV_HEADS, HEAD_DIM = 36, 5, 8, 128
BYTES_PER_TOKEN = (TARGET_LAYERS + DRAFT_LAYERS) * 2 * KV_HEADS * HEAD_DIM * 2  # 167,936


def make_chunks(tokens: int, count: int) -> list[KVChunk]:
    """`count` chunks of one random K/V payload under distinct keys (content does not change the cost)."""
    g = torch.Generator().manual_seed(tokens)
    tk = torch.randn(TARGET_LAYERS, 2, tokens, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    dk = torch.randn(DRAFT_LAYERS, 2, tokens, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    tag = uuid.uuid4().hex[:12]
    return [KVChunk(f"bench-{tag}-{tokens}-{i}", "", "bench", list(range(tokens)), tk, dk) for i in range(count)]


def start_server(memory_bytes: int, arena: bool = False, populate: bool = True) -> tuple[subprocess.Popen, str]:
    """A bridge server in its own process (arena: its memory tier in a shared-memory arena, kv_bridge/arena.py,
    faulted in at start unless populate is False)."""
    # the bridge shares this process's cluster secret, so the default clients here may use it
    proc = subprocess.Popen([sys.executable, "-m", "flashpd.kv_bridge.server", "--memory-bytes", str(memory_bytes),
                             *(["--arena"] if arena else []), *([] if populate else ["--no-arena-populate"])],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, **process_secret().child_env()))
    line = proc.stdout.readline().strip()  # "PORT n", printed once the server listens
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"bridge server did not start: {line!r}")
    return proc, f"127.0.0.1:{line.split()[1]}"


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by this process, or by process `pid`."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn, server_pid: int) -> tuple[float, float, float]:
    """Wall seconds of fn(), and the CPU seconds this process and the server spent meanwhile."""
    c0, s0, t0 = cpu_s(), cpu_s(server_pid), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    return wall, cpu_s() - c0, cpu_s(server_pid) - s0


def copy_out(chunks: list, dst: list[torch.Tensor]) -> None:
    """What a restore does with a fetched chunk: its bytes copied out (here into a host buffer, on a worker into its
    caches), then checked still to be the chunk's (KVChunk.fresh: an arena's chunk is read in place)."""
    for c in chunks:
        dst[0].copy_(c.target_kv)
        dst[1].copy_(c.draft_kv)
        if not c.fresh():
            raise RuntimeError(f"chunk {c.key} went stale while it was copied out")


def run_config(address: str, server_pid: int, tokens: int, frame_bytes: int, transport: str, streams: int,
               total_bytes: int, timeout_s: float, consume: bool = False,
               shm_pool_bytes: int = shm_pool.DEFAULT_POOL_BYTES) -> dict:
    chunk_bytes = len(make_chunks(tokens, 1)[0].to_bytes(process_secret().mac_key))
    count = max(streams, round(total_bytes / chunk_bytes))
    chunks = make_chunks(tokens, count)
    keys = [c.key for c in chunks]
    got: list = []
    with BridgeClient(address, timeout_s=timeout_s, frame_bytes=frame_bytes, streams=streams,
                      shm_pool_bytes=shm_pool_bytes) as client:
        warm = make_chunks(16, streams)  # every stream's channel connects before timing
        _check_put(client.put(warm, transport=transport), streams)
        if transport != "inline":  # a same-host Put's pool files are the chunk's size before timing
            _check_put(client.put(make_chunks(tokens, 1), transport=transport), 1)
            time.sleep(1.0)
        client.get([c.key for c in warm], transport=transport)
        put = timed(lambda: _check_put(client.put(chunks, transport=transport), count), server_pid)
        dst = [torch.empty_like(chunks[0].target_kv), torch.empty_like(chunks[0].draft_kv)]

        def get_all() -> None:
            for c in client.iter_get(keys, transport=transport):
                got.append(c.key)
                if consume:
                    copy_out([c], dst)

        get = timed(get_all, server_pid)
    if len(got) != count:
        raise RuntimeError(f"got {len(got)} of {count} chunks back (store budget too small?)")
    moved = count * chunk_bytes
    gb = moved / 1e9
    return {"transport": transport, "get_copies_out": consume, "chunk_tokens": tokens, "chunk_bytes": chunk_bytes,
            "frame_bytes": frame_bytes if transport == "inline" else None, "streams": streams, "chunks": count,
            "shm_pool_bytes": shm_pool_bytes if transport != "inline" else None,
            "bytes_moved": moved, "put_s": put[0], "get_s": get[0],
            "put_gb_per_s": gb / put[0], "get_gb_per_s": gb / get[0],
            "put_cpu_s_per_gb": {"client": put[1] / gb, "server": put[2] / gb},
            "get_cpu_s_per_gb": {"client": get[1] / gb, "server": get[2] / gb},
            "put_tokens_per_s": count * tokens / put[0], "get_tokens_per_s": count * tokens / get[0]}


def wait_populated(address: str, timeout_s: float = 300.0) -> float:
    """Wait until the arena bridge at address has faulted its arena in (ArenaStore populate); returns the wait."""
    t0 = time.perf_counter()
    with BridgeClient(address, timeout_s=30) as c:
        while time.perf_counter() - t0 < timeout_s:
            st = c.stats()
            if st["store.arena_populated_bytes"] >= st["store.arena_bytes"] - (st["store.arena_bytes"] >> 6):
                return time.perf_counter() - t0
            time.sleep(0.05)
    raise RuntimeError(f"the arena bridge did not fault its arena in within {timeout_s:g} s")


def _check_put(summary, n: int) -> None:
    if summary.stored + summary.duplicates != n:
        raise RuntimeError(f"put stored {summary.stored} of {n}: {summary}")


def reference_rates(nbytes: int = 64 << 20) -> dict:
    """What one core does to the same bytes: keyed BLAKE3 (the chunk MAC) and a copy into fresh memory."""
    data = os.urandom(nbytes)
    t = time.perf_counter()
    blake3.blake3(data, key=bytes(32), max_threads=1).digest()
    h = time.perf_counter() - t
    t = time.perf_counter()
    bytearray(data)
    c = time.perf_counter() - t
    return {"blake3_gb_per_s": nbytes / h / 1e9, "memcpy_gb_per_s": nbytes / c / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="KV bridge loopback throughput")
    ap.add_argument("--chunk-tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--frame-mib", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    ap.add_argument("--transports", nargs="+", default=["inline", "shm"], choices=["inline", "shm", "arena"],
                    help="arena: a second server keeps its entries in a shared-memory arena (kv_bridge/arena.py)")
    ap.add_argument("--copy-out", action="store_true",
                    help="the Get phase also copies each chunk's K/V out, as a restore does (an arena chunk is read "
                         "in place, so without this its bytes are not all read)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--total-mib", type=int, default=256, help="chunk bytes moved per config and direction")
    ap.add_argument("--arena-populate", choices=("on", "off"), default="on",
                    help="the arena bridge faults its pages in at start (waited for before timing), or not")
    ap.add_argument("--shm-pool-mib", type=int, default=shm_pool.DEFAULT_POOL_BYTES >> 20,
                    help="the client's pool of pre-allocated Put segment files (kv_bridge/shm_pool.py; 0: none)")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default="bench/results/bridge_throughput_cpu.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    total = args.total_mib << 20
    load_before = os.getloadavg()  # other work on the same cores skews every number: recorded
    proc, address = start_server(memory_bytes=4 * total + (256 << 20))
    procs = [proc]
    if "arena" in args.transports:
        aproc, arena_address = start_server(memory_bytes=4 * total + (256 << 20), arena=True,
                                            populate=args.arena_populate == "on")
        procs.append(aproc)
        if args.arena_populate == "on":
            print(f"arena faulted in after {wait_populated(arena_address):.2f} s", flush=True)
    rows = []
    try:
        run_config(address, proc.pid, 16, 1 << 20, "inline", 1, 8 << 20, args.timeout_s)  # warm-up
        for transport in args.transports:
            frames = [int(f * (1 << 20)) for f in args.frame_mib] if transport == "inline" else [1 << 20]
            addr, server = (arena_address, procs[-1]) if transport == "arena" else (address, proc)
            for tokens in args.chunk_tokens:
                for frame in frames:
                    for streams in args.streams:
                        r = run_config(addr, server.pid, tokens, frame, transport, streams, total, args.timeout_s,
                                       args.copy_out, args.shm_pool_mib << 20)
                        rows.append(r)
                        fb = "-" if r["frame_bytes"] is None else f"{r['frame_bytes'] / (1 << 20):g}"
                        pc, gc = r["put_cpu_s_per_gb"], r["get_cpu_s_per_gb"]
                        print(f"{transport:6s} tokens={tokens:4d} chunk={r['chunk_bytes'] / (1 << 20):6.2f}MiB "
                              f"frame={fb:>4s}MiB streams={streams} put={r['put_gb_per_s']:.3f} GB/s "
                              f"get={r['get_gb_per_s']:.3f} GB/s  cpu-s/GB put {pc['client']:.2f}+{pc['server']:.2f} "
                              f"get {gc['client']:.2f}+{gc['server']:.2f} (client+server)", flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    ref = reference_rates()
    cmd = "python -m flashpd.bench.bridge_throughput " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    path = write_json(args.out, {"command": cmd, "bytes_per_token": BYTES_PER_TOKEN, "total_bytes_per_config": total,
                                 "arena_populate": args.arena_populate,
                                 "cpu_cores": os.cpu_count(), "loadavg_before": load_before,
                                 "loadavg_after": os.getloadavg(), "reference_single_core": ref, "results": rows})
    print(f"single core: blake3 {ref['blake3_gb_per_s']:.2f} GB/s, memcpy {ref['memcpy_gb_per_s']:.2f} GB/s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

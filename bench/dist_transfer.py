"""The cross-host path's data plane (kv_bridge/dist_transfer.py): send_blocks -> recv_blocks between two
processes over a PairGroup, NCCL on GPUs, gloo on CPUs.

    python -m flashpd.bench.dist_transfer --config qwen3-8b --device cuda --tokens 2048 \\
        --out bench/results/dist_transfer_h200.json                     # two GPUs: ranks on cuda:0 and cuda:1
    python -m flashpd.bench.dist_transfer --config tiny --device cpu --tokens 2048 --out /tmp/dist.json  # a check

Rank 0 plays the prefill worker (paged caches of the config's shape: target layers and a 5-layer drafter's
context), rank 1 the decode worker. Per repetition rank 1 signals rank 0 (a one-element message), rank 0
gathers the prompt's blocks of both halves and sends them, rank 1 receives and scatters them into other
block ids; rank 1 times signal to scatter done. gRPC control (OpenPair, SendLease: about one RPC per
request) is not in these numbers. The first transfer is checked bit for bit.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashpd.bench.common import write_json
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.kv_bridge.dist_transfer import PairGroup, gather_blocks, recv_blocks

BLOCK = 16
DRAFT_LAYERS = 5


def _shape(cfg_name: str, layers: int | None) -> tuple[int, int, int]:
    if cfg_name == "tiny":
        return layers or 4, 2, 32
    c = load_config(builtin_config_path(cfg_name))
    return layers or c.num_hidden_layers, c.num_key_value_heads, c.head_dim


def _caches(a, device: torch.device, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same filled caches on both ranks (CPU generator, so rank 1 can check what it received)."""
    layers, kv, hd = _shape(a.config, a.layers)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, a.dtype)
    t = torch.randn(layers, 2, blocks, BLOCK, kv, hd, generator=g).to(device=device, dtype=dtype)
    d = torch.randn(DRAFT_LAYERS, 2, blocks, BLOCK, kv, hd, generator=g).to(device=device, dtype=dtype)
    return t, d


def _rank(rank: int, a, port: int, out) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    device = torch.device(f"cuda:{rank}") if a.device == "cuda" else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    pair = PairGroup(dist.PrefixStore("bench/", store), rank, device, "127.0.0.1", 60.0)
    nblk = -(-a.tokens // BLOCK)
    t, d = _caches(a, device, 2 * nblk)
    src = list(range(0, 2 * nblk, 2))  # every other block: a gather, as a real lease's blocks are scattered
    dst = list(range(2 * nblk - 1, 0, -2))
    go = torch.zeros(1, device=device)
    times, gathers = [], []
    for rep in range(a.warmup + a.reps):
        if rank == 0:
            pair.recv([go], 3 * rep, 60.0)
            t0 = time.perf_counter()
            bufs = gather_blocks(t, d, src)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            gathers.append((time.perf_counter() - t0) * 1e3)
            pair.send(bufs, 3 * rep + 1, 60.0)
        else:
            if rep == 0:
                want = [c[:, :, src].clone() for c in (t, d)]
                t.zero_(), d.zero_()
            t0 = time.perf_counter()
            pair.send([go], 3 * rep, 60.0)
            recv_blocks(pair, t, d, dst, 3 * rep + 1, 60.0)
            times.append((time.perf_counter() - t0) * 1e3)
            if rep == 0:
                assert all(torch.equal(c[:, :, dst], w) for c, w in zip((t, d), want)), "not bit-exact"
                del want
    if rank == 1:
        nbytes = sum(c[:, :, :nblk].numel() * c.element_size() for c in (t, d))
        out.put(dict(ms=times[a.warmup:], bytes=nbytes, backend=pair.backend))
    else:
        out.put(dict(gather_ms=gathers[a.warmup:]))
    time.sleep(0.5)  # let the peer finish reading before the group goes away
    pair.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="qwen3-8b", help="engine/configs name, or 'tiny'")
    ap.add_argument("--layers", type=int, help="target layers (default: the config's)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    if a.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs two GPUs (NCCL puts one rank per GPU)")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, a, store.port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    res = next(g for g in got if "ms" in g)
    gather = next(g for g in got if "gather_ms" in g)["gather_ms"]
    med = statistics.median(res["ms"])
    layers, kv, hd = _shape(a.config, a.layers)
    payload = dict(config=a.config, target_layers=layers, draft_layers=DRAFT_LAYERS, kv_heads=kv, head_dim=hd,
                   tokens=a.tokens, block=BLOCK, device=a.device, backend=res["backend"], dtype=a.dtype,
                   bytes=res["bytes"], reps=a.reps, ms=res["ms"], ms_median=med,
                   gather_ms_median=statistics.median(gather), gbps=res["bytes"] / med / 1e6)
    write_json(a.out, payload)
    print({k: v for k, v in payload.items() if k != "ms"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

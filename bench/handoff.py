"""The same-host device path's P->D handoff between two processes on one device (kv_bridge/handoff.py).

    python -m flashpd.bench.handoff --config qwen3-8b --tokens 2048 --out bench/results/handoff_h200.json  # GPU
    python -m flashpd.bench.handoff --config tiny --device cpu --tokens 256 --out /tmp/handoff.json         # a check

This process plays the prefill worker: paged caches of the config's shape (target layers and a 5-layer
drafter's context, random bf16 on a GPU), an exporter, one lease of the prompt's blocks per repetition.
A child process plays the decode worker: it receives each handoff (control data only), copies the
lease's blocks into its own caches, checks the epochs and answers with the time it took. The first
import also maps the exporter's caches (CUDA IPC / shared memory): reported apart. Every copy is
checked bit for bit against the exporter's blocks through the child's mapping.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time

import torch

from flashpd.bench.common import write_json
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.handoff import CacheExporter, CacheImporter, Handoff

BLOCK = 16
DRAFT_LAYERS = 5


def _shape(cfg_name: str) -> tuple[int, int, int]:
    if cfg_name == "tiny":
        return 4, 2, 32
    c = load_config(builtin_config_path(cfg_name))
    return c.num_hidden_layers, c.num_key_value_heads, c.head_dim


def _caches(cfg_name: str, blocks: int, device: str, dtype: torch.dtype, fill: bool):
    layers, kv, hd = _shape(cfg_name)
    mk = (torch.randn if fill else torch.zeros)
    t = mk(layers, 2, blocks, BLOCK, kv, hd, device=device, dtype=dtype)
    d = mk(DRAFT_LAYERS, 2, blocks, BLOCK, kv, hd, device=device, dtype=dtype)
    return t, d


def child(args: argparse.Namespace) -> None:
    """The decode side: import each handoff read from stdin, answer one JSON line per import."""
    if args.device == "cpu":
        import torch.multiprocessing as mp
        mp.set_sharing_strategy("file_system")
    dtype = getattr(torch, args.dtype)
    t, d = _caches(args.config, args.blocks, args.device, dtype, fill=False)
    imp = CacheImporter(t, d, "bench", ClusterSecret.from_env().mac_key)
    print("ready", flush=True)
    for line in sys.stdin.buffer:
        h = Handoff(**pickle.loads(bytes.fromhex(line.decode().strip())))
        dst = list(range(args.blocks - len(h.blocks), args.blocks))[::-1]  # other slots than the source's
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        imp.copy(h, dst)  # includes the device sync and the epoch re-check
        ms = (time.perf_counter() - t0) * 1e3
        src_t, src_d = imp._maps[h.exporter_id][:2]
        idx = torch.tensor(h.blocks, device=t.device)
        didx = torch.tensor(dst, device=t.device)
        ok = torch.equal(t.index_select(2, didx), src_t.index_select(2, idx)) and \
            torch.equal(d.index_select(2, didx), src_d.index_select(2, idx))
        print(json.dumps({"ms": ms, "exact": bool(ok)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="P->D handoff over the same-host device path")
    ap.add_argument("--config", default="qwen3-8b", help="qwen3-4b, qwen3-8b, qwen3-32b, or tiny")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    nblk = -(-args.tokens // BLOCK)
    args.blocks = args.blocks or 2 * nblk + 8
    if args.child:
        child(args)
        return 0
    if args.device == "cpu":
        import torch.multiprocessing as mp
        mp.set_sharing_strategy("file_system")
    secret = ClusterSecret.generate()
    dtype = getattr(torch, args.dtype)
    t, d = _caches(args.config, args.blocks, args.device, dtype, fill=True)
    if args.device == "cpu":
        t.share_memory_()
        d.share_memory_()
    ex = CacheExporter(t, d, "bench", secret.mac_key, lease_s=600)
    cmd = [sys.executable, "-m", "flashpd.bench.handoff", "--child", "--config", args.config, "--device", args.device,
           "--dtype", args.dtype, "--tokens", str(args.tokens), "--blocks", str(args.blocks)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, **secret.child_env()})
    assert proc.stdout.readline().strip() == b"ready", "child did not start"
    nbytes = (t[:, :, :1].numel() + d[:, :, :1].numel()) * t.element_size() * nblk
    times, exact = [], []
    try:
        for i in range(args.reps + 1):
            h = ex.lease(list(range(nblk)), args.tokens, lambda: None)
            proc.stdin.write((pickle.dumps(h.__dict__).hex() + "\n").encode())
            proc.stdin.flush()
            r = json.loads(proc.stdout.readline())
            times.append(r["ms"])
            exact.append(r["exact"])
            ex.release(h.lease_id, h.blocks, h.epochs)
    finally:
        proc.stdin.close()
        proc.wait(60)
    steady = times[1:]
    med = statistics.median(steady)
    out = {"config": args.config, "tokens": args.tokens, "device": args.device, "dtype": args.dtype,
           "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "bytes_per_handoff": nbytes, "first_import_ms_with_map": times[0], "import_ms": steady,
           "import_ms_median": med, "gbps_median": nbytes / med / 1e6, "exact": f"{sum(exact)}/{len(exact)}",
           "command": " ".join([os.path.basename(sys.executable), "-m", "flashpd.bench.handoff"] +
                                (sys.argv[1:] if argv is None else list(argv)))}
    print(f"{args.config} {args.tokens} tokens: {nbytes / 1e6:.1f} MB a handoff; first (maps the caches) "
          f"{times[0]:.2f} ms; then median {med:.3f} ms ({out['gbps_median']:.1f} GB/s); exact {out['exact']}")
    if args.out:
        write_json(args.out, out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

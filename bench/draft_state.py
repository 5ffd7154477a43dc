"""Draft-state reconstruction on import: move the drafter's K/V, or move the fused context
feature and recompute the K/V? Bytes per token, time, and exactness of both, at a real shape.

    python -m flashpd.bench.draft_state --config qwen3-8b --out bench/results/draft_state_cpu.json

(ii) "draft_kv": the chunk carries K/V of every draft layer (what kv_bridge/chunk.py moves).
(i) "feature": the chunk carries ctx = hidden_norm(fc(taps)) per position; the importer re-runs
each draft layer's k/v projection, k_norm and RoPE (drafter.context_kv_all after its fc).
Per path: bytes per token; time to move those bytes through the same-host path (XXH3 checksum +
write and take of a /dev/shm segment, kv_bridge/shm.py), the recompute (feature path only) and
the scatter into a paged draft cache; and whether recomputing chunk by chunk gives the same bits
as the cold prefill, which computes the prompt's rows in one call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import xxhash

from flashpd.bench.common import summary, time_ms, write_json
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.layers import Rotary, apply_rotary, rms_norm
from flashpd.kv_bridge import shm

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def kv_from_feature(ctx: torch.Tensor, w_kv: torch.Tensor, w_kn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    eps: float, n_kv: int, d: int) -> torch.Tensor:
    """What a feature-path importer runs: ctx [N, H] -> draft K/V [layers, 2, N, kv, d].
    Mirrors engine/drafter.context_kv_all after its fc + hidden_norm."""
    n, n_l = ctx.shape[0], w_kv.shape[0]
    kv = torch.matmul(ctx.unsqueeze(0), w_kv.transpose(1, 2))
    k, v = kv.split([n_kv * d, n_kv * d], dim=-1)
    k = apply_rotary(rms_norm(k.view(n_l, n, n_kv, d), w_kn.view(n_l, 1, 1, d), eps), cos, sin)
    return torch.stack([k, v.view(n_l, n, n_kv, d)], dim=1)


def move_bytes(t: torch.Tensor) -> None:
    """The same-host bridge path for one payload: checksum, write a segment, take it back."""
    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy()
    digest = xxhash.xxh3_128_digest(raw)
    data = shm.take_segment(shm.write_segment(memoryview(raw).cast("B")), raw.nbytes)
    if xxhash.xxh3_128_digest(data) != digest:
        raise RuntimeError("payload changed in transit")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2723)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/draft_state_cpu.json")
    a = ap.parse_args(argv)
    cfg = load_config(builtin_config_path(a.config))
    dt, dev, n = _DTYPES[a.dtype], torch.device(a.device), a.tokens
    n_l, n_kv, d, h = a.draft_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    g = torch.Generator(device=dev).manual_seed(0)
    w_kv = (torch.randn(n_l, 2 * n_kv * d, h, generator=g, device=dev) * 0.02).to(dt)
    w_kn = torch.ones(n_l, d, device=dev, dtype=dt)
    rot = Rotary(d, cfg.rope_theta, n + 16, dev)
    cos, sin = rot.tables(torch.arange(n, device=dev), dt)
    ctx = rms_norm(torch.randn(n, h, generator=g, device=dev).to(dt), torch.ones(h, device=dev, dtype=dt),
                   cfg.rms_norm_eps)
    kv = kv_from_feature(ctx, w_kv, w_kn, cos, sin, cfg.rms_norm_eps, n_kv, d)
    cache = torch.zeros(n_l, 2, n + a.chunk, n_kv, d, device=dev, dtype=dt)  # a paged cache, flat slots
    slots = torch.randperm(n + a.chunk, generator=g, device=dev)[:n]
    sync = a.device if dev.type == "cuda" else "cpu"

    def recompute() -> torch.Tensor:
        return kv_from_feature(ctx, w_kv, w_kn, cos, sin, cfg.rms_norm_eps, n_kv, d)

    def scatter(x: torch.Tensor) -> None:
        cache.index_copy_(2, slots, x)

    chunked = torch.cat([kv_from_feature(ctx[i:i + a.chunk], w_kv, w_kn, cos[i:i + a.chunk], sin[i:i + a.chunk],
                                         cfg.rms_norm_eps, n_kv, d) for i in range(0, n, a.chunk)], dim=2)
    item = torch.empty((), dtype=dt).element_size()
    target_bpt = cfg.num_hidden_layers * 2 * n_kv * d * item
    paths = {"draft_kv": {"bytes_per_token": n_l * 2 * n_kv * d * item, "payload": kv},
             "feature": {"bytes_per_token": h * item, "payload": ctx}}
    rows = {}
    for name, p in paths.items():
        move = time_ms(lambda: move_bytes(p["payload"]), warmup=1, reps=a.reps, device=sync)
        comp = time_ms(recompute, warmup=1, reps=a.reps, device=sync) if name == "feature" else [0.0] * a.reps
        write = time_ms(lambda: scatter(kv), warmup=1, reps=a.reps, device=sync)
        total = statistics.median(move) + statistics.median(comp) + statistics.median(write)
        rows[name] = {"bytes_per_token": p["bytes_per_token"],
                      "bytes_per_token_with_target": target_bpt + p["bytes_per_token"],
                      "x_target_bytes": p["bytes_per_token"] / target_bpt,
                      "move_same_host": summary(move), "recompute": summary(comp), "scatter": summary(write),
                      "import_ms_median_sum": total}
        print(f"{name:8s}: {p['bytes_per_token']:6d} B/token (+{100 * p['bytes_per_token'] / target_bpt:.1f}% of the "
              f"target's {target_bpt}); move {statistics.median(move):8.2f} ms, recompute "
              f"{statistics.median(comp):8.2f} ms, scatter {statistics.median(write):6.2f} ms -> {total:8.2f} ms "
              f"for {n} tokens", flush=True)
    exact = {"chunked_equals_whole_prompt": bool(torch.equal(chunked, kv)),
             "max_abs_diff": float((chunked.float() - kv.float()).abs().max())}
    print(f"recompute chunk by chunk ({a.chunk}) vs whole prompt, {a.dtype} on {a.device}: {exact}")
    cmd = "python -m flashpd.bench.draft_state " + " ".join(sys.argv[1:] if argv is None else argv)
    write_json(a.out, {"loadavg_after": os.getloadavg(), "bench": "draft_state", "config": a.config, "draft_layers": n_l, "tokens": n,
                       "chunk_tokens": a.chunk, "dtype": a.dtype, "device": a.device, "weights": "random",
                       "paths": rows, "exactness": exact, "command": cmd})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU time of one decode/verify attention over a padded, masked key range, by implementation.

    python -m flashpd.bench.attn_micro --out bench/results/attn_micro_h200.json

Why: at batch 1 a masked SDPA call may run on a handful of thread blocks that walk every key in
turn, so its cost grows with the padded context while the GPU idles. This times, inside a CUDA
graph (no launch overhead), the engine's grouped SDPA against an explicit-matmul form and the
same under torch.compile, for the demo pair's and Qwen3-8B's head shapes, and checks they agree.
"""
from __future__ import annotations

import argparse

import torch

from flashpd.bench.common import write_json
from flashpd.engine.attention import group_mask, group_queries, grouped_sdpa


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The explicit-matmul form in the engine's kv-major layout (attention.group_queries), from and to the
    usual layouts: q [B, T, Hq, d], k, v [B, Hkv, L, d], a `group_mask` mask -> [B, T, Hq*d]."""
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    qg = group_queries(q, hkv)
    s = torch.matmul(qg, k.transpose(0, 1).transpose(-1, -2)).float() * scale
    s = s.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v.transpose(0, 1))
    return out.view(hkv, b, t, hq // hkv, d).permute(1, 2, 0, 3, 4).reshape(b, t, hq * d)


def graph_time(fn, reps: int = 50, inner: int = 14) -> float:
    """Microseconds per call, from a CUDA graph of `inner` calls replayed `reps` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / inner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/attn_micro.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    compiled_sdpa = torch.compile(grouped_sdpa, dynamic=False)
    compiled_mm = torch.compile(matmul_attention, dynamic=False)
    rows = []
    for name, hq, hkv, d in (("demo", 4, 2, 48), ("qwen3-8b", 32, 8, 128)):
        for b in (1, 8):
            for t in (1, 16):
                for ctx, keys in ((200, 256), (2100, 4096)):
                    q = torch.randn(b, t, hq, d, device=dev, dtype=dt)
                    k = torch.randn(b, hkv, keys, d, device=dev, dtype=dt)
                    v = torch.randn(b, hkv, keys, d, device=dev, dtype=dt)
                    pos = torch.arange(ctx, ctx + t, device=dev)[None].expand(b, t)
                    m = (torch.arange(keys, device=dev)[None, None, :] <= pos[:, :, None]).unsqueeze(1)
                    gm = group_mask(m, hq // hkv)
                    sc = d ** -0.5
                    ref = matmul_attention(q.float(), k.float(), v.float(), gm, sc)
                    row = {"shape": name, "batch": b, "queries": t, "context": ctx + t, "padded_keys": keys}
                    for label, fn in (("sdpa_mask", grouped_sdpa), ("matmul", matmul_attention),
                                      ("sdpa_mask_compiled", compiled_sdpa), ("matmul_compiled", compiled_mm)):
                        out = fn(q, k, v, gm, sc)
                        row[label + "_max_err"] = (out.float() - ref).abs().max().item()
                        row[label + "_us"] = graph_time(lambda: fn(q, k, v, gm, sc))
                    print(row, flush=True)
                    rows.append(row)
    write_json(a.out, {"bench": "attn_micro", "rows": rows})


if __name__ == "__main__":
    main()

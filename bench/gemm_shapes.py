"""A step's weight matmuls alone, by row count and kernel, at the Qwen3-8B shape.

    python -m flashpd.bench.gemm_shapes --rows 1,16,128 --out bench/results/gemm_shapes.json
    python -m flashpd.bench.gemm_shapes --weights fp8 --rows 16 --shapes qkv,o_proj,gate_up,down,fc,head16k \
        --variants skinny,skinny:16-256-2-6 --out bench/results/gemm_shapes_fp8.json

Each projection (q/k/v fused, o_proj, gate/up fused, down; the LM head) is timed as a step meets it: a CUDA
graph of one call per layer (36 weights of the shape, each read once a replay, so no weight stays in L2; the LM
head once), replayed. Variants: "cublas" (F.linear, the engine's call), "cublas_nn" (x @ w_t with the weight
stored [K, N]), "cublaslt" (F.linear with torch's preferred BLAS library set to cuBLASLt), "skinny:n-k-w-s"
(engine/skinny_gemm.py's kernel at a tile: BLOCK_N, BLOCK_K, warps, stages; up to 16 rows; "skinny" alone: the
engine's tile for the shape) and "gemv:n-k-w-s" (an FMA GEMV, one row) and "splitk:bm-bn-bk-splits-w-s" (bench/splitk_gemm.py's split-K kernel
and its reduction at a tile) and "lt:N" (cuBLASLt's heuristic's first N algorithms, each timed as its own row "lt#i" with
the configuration cuBLASLt reports: bench/cublaslt.py). It reports microseconds a call, the
weight's GB/s and that over the copy rate measured in the same run, the largest difference from F.linear in
fp32, and for the skinny tiles whether a row's bits are the same alone and inside 16 rows. --weights fp8: the
weights as a draft pass in fp8 holds them (`skinny_gemm.quantize_fp8`, e4m3 with a scale a row; one byte a
weight in the rate), the skinny variants only, the error against the widened weight's product in fp32.
"""
from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F

from flashpd.bench import cublaslt
from flashpd.bench import splitk_gemm as bg
from flashpd.bench.common import command_line, copy_bandwidth_gbs, write_json
from flashpd.engine import skinny_gemm as sg

if sg.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, swn, BN: tl.constexpr, BK: tl.constexpr):
        """One row by FMA instead of MMA: the bandwidth a plain GEMV reaches, for comparison."""
        pid = tl.program_id(0)
        rn = pid * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        n_ok = rn < N
        acc = tl.zeros([BN, BK], tl.float32)
        for k in range(0, K, BK):
            a = tl.load(x_ptr + k + rk)
            w = tl.load(w_ptr + rn[:, None] * swn + (k + rk)[None, :], mask=n_ok[:, None], other=0.0)
            acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        tl.store(y_ptr + rn, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=n_ok)


def launch_gemv(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_warps: int, num_stages: int
                ) -> torch.Tensor:
    """x [1, K] -> x @ w.T [1, N] by `_gemv_kernel` (K a multiple of block_k)."""
    n, k = w.shape
    assert x.shape == (1, k) and k % block_k == 0
    y = x.new_empty((1, n))
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, y, n, k, w.stride(0), BN=block_n, BK=block_k,
                                             num_warps=num_warps, num_stages=num_stages)
    return y


# (name, N, K, copies): Qwen3-8B (hidden 4096, 32 q heads and 8 kv heads of 128, MLP 12288, vocab 151936)
SHAPES = (("qkv", 6144, 4096, 36), ("o_proj", 4096, 4096, 36), ("gate_up", 24576, 4096, 36),
          ("down", 4096, 12288, 36), ("lm_head", 151936, 4096, 1))
# the drafter's own shapes, by name only: its fc (5 target layers' hidden states -> hidden) and a 16,384-id head
EXTRA_SHAPES = (("fc", 4096, 20480, 5), ("head16k", 16384, 4096, 1))


def graph_us(calls: list, reps: int = 10) -> float:
    """Microseconds a call: the calls captured in one CUDA graph, replayed `reps` times (median of 5)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / reps / len(calls))
    return statistics.median(times)


def spec(v: str, n_out: int = 0, k_in: int = 0, fp8: bool = False) -> dict[str, int]:
    """"skinny:16-128-2-6" -> the tile's arguments; "skinny" -> the engine's tile for an [n_out, k_in] weight."""
    n, k, w, s = (int(p) for p in v.split(":")[1].split("-")) if ":" in v else sg.tile(n_out, k_in, fp8)
    return {"block_n": n, "block_k": k, "num_warps": w, "num_stages": s}


def call(variant: str, x: torch.Tensor, w: sg.Weight, wt: torch.Tensor | None):
    if isinstance(w, sg.Fp8Weight):
        if not variant.startswith("skinny"):
            raise ValueError(f"fp8 weights take the skinny variants only, not {variant!r}")
        kw = spec(variant, *w.shape, fp8=True)
        return lambda: sg.launch(x, w.data, **kw, w_scale=w.scale)
    if variant in ("cublas", "cublaslt"):
        return lambda: F.linear(x, w)
    if variant == "cublas_nn":
        return lambda: x @ wt
    if variant.startswith("skinny"):
        kw = spec(variant, *w.shape)
        return lambda: sg.launch(x, w, **kw)
    if variant.startswith("gemv:"):
        kw = spec(variant)
        return lambda: launch_gemv(x, w, **kw)
    if variant.startswith("splitk"):
        t = splitk_tile(variant)
        return lambda: bg.launch(x, w, t)
    raise ValueError(f"unknown variant {variant!r}")


def splitk_tile(v: str) -> bg.Tile:
    """"splitk:128-128-64-4-8-4" -> that tile."""
    return bg.Tile.parse(v.split(":")[1])


def applies(variant: str, m: int, n: int, k: int) -> bool:
    if variant.startswith("splitk:"):
        t = splitk_tile(variant)
        return k % t.block_k == 0 and t.splits <= k // t.block_k
    if variant.startswith("skinny"):
        return m <= sg.MAX_ROWS
    if variant.startswith("gemv:"):
        return m == 1 and k % spec(variant)["block_k"] == 0
    return True


def measure(name: str, n: int, k: int, m: int, v: str, fns: list, ref: torch.Tensor, copy: dict,
            config: dict | None, print_now: bool = True, weight_bytes: int = 2) -> dict:
    """One variant's row: microseconds a call in a graph of the calls, the weight's rate, the error in fp32."""
    err = (fns[0]().float() - ref).abs().max().item()
    us = graph_us(fns)
    wbytes = n * k * weight_bytes
    row = {"shape": name, "n": n, "k": k, "rows": m, "variant": v, "weight_bytes": weight_bytes, "us_per_call": us,
           "weight_gb_per_s": wbytes / (us * 1e-6) / 1e9,
           "of_copy_rate": wbytes / (us * 1e-6) / 1e9 / copy["gb_per_s"], "max_abs_err_fp32": err}
    if config is not None:
        row["lt_config"] = config
    if print_now:
        report(row)
    return row


def report(row: dict) -> None:
    print(f"{row['shape']:8s} M={row['rows']:3d} {row['variant']:22s} {row['us_per_call']:8.2f} us  "
          f"{row['of_copy_rate']:.3f} of copy  err {row['max_abs_err_fp32']:.2e}"
          + (f"  invariant {row['row_bits_invariant']}" if "row_bits_invariant" in row else "")
          + (f"  {row['lt_config']}" if "lt_config" in row else ""), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,128")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--variants", default="cublas,cublas_nn,skinny,gemv:8-512-4-4")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--out", default="bench/results/gemm_shapes.json")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    variants = a.variants.split(",")
    fp8 = a.weights == "fp8"
    if fp8 and any(not v.startswith("skinny") for v in variants):
        ap.error("--weights fp8 takes the skinny variants only")
    names = a.shapes.split(",")
    known = {s[0] for s in SHAPES + EXTRA_SHAPES}
    if set(names) - known:
        ap.error(f"unknown shapes {sorted(set(names) - known)}; known: {sorted(known)}")
    copy = copy_bandwidth_gbs()
    print(f"copy rate {copy['gb_per_s']:.0f} GB/s", flush=True)
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k, copies in SHAPES + EXTRA_SHAPES:
        if name not in names:
            continue
        ws = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        if fp8:
            ws = [sg.quantize_fp8(w) for w in ws]
        wts = [w.t().contiguous() for w in ws] if "cublas_nn" in variants else [None] * copies
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].dequantize(torch.float32) if fp8 else ws[0].float())
            for v in variants:
                if not applies(v, m, n, k):
                    continue
                if v.startswith("lt:"):
                    lt = cublaslt.LtGemm(m, n, k, max_algos=int(v.split(":")[1]))
                    print(f"{name:8s} M={m:3d} cuBLASLt offers {len(lt)} algorithms", flush=True)
                    for i in range(len(lt)):
                        fns = [functools.partial(lt, x, ws[j], i) for j in range(copies)]
                        results.append(measure(name, n, k, m, f"lt#{i}", fns, ref, copy, lt.describe(i)))
                    continue
                torch.backends.cuda.preferred_blas_library("cublaslt" if v == "cublaslt" else "cublas")
                fns = [call(v, x, ws[i], wts[i]) for i in range(copies)]
                row = measure(name, n, k, m, v, fns, ref, copy, None, print_now=False, weight_bytes=1 if fp8 else 2)
                if v.startswith("skinny") and m > 1:
                    full = fns[0]()
                    row["row_bits_invariant"] = all(
                        torch.equal(call(v, x[i:i + 1], ws[0], None)(), full[i:i + 1]) for i in range(m))
                if v.startswith("splitk") and m > 1:
                    t = splitk_tile(v)
                    full = bg.launch(x, ws[0], t)
                    row["row_bits_invariant"] = all(torch.equal(bg.launch(x[i:i + 1], ws[0], t), full[i:i + 1])
                                                    for i in (0, m // 2, m - 1))
                results.append(row)
                report(row)
        torch.backends.cuda.preferred_blas_library("cublas")
        del ws, wts
        torch.cuda.empty_cache()
    write_json(a.out, {"bench": "gemm_shapes", "command": command_line("flashpd.bench.gemm_shapes"),
                       "weights": a.weights, "copy_bandwidth": copy, "results": results})


if __name__ == "__main__":
    main()

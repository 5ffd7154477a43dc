"""Diagnosis: does prefetching the o_proj weight into L2 while a latency-bound kernel runs (attention at batch 1)
make the following few-row o_proj GEMM faster?  Emulates attention with a one-program serial loop of ~T us; the
same launch's other programs issue L2 prefetches over the next weight ("embedded"), or a separate prefetch kernel
runs before it ("standalone").  24 weights a CUDA graph so L2 never holds a weight from a previous rep."""
import json, os, sys
import torch
import triton
import triton.language as tl
from flashpd.bench.gemm_shapes import graph_us
from flashpd.engine import skinny_gemm as sg


@triton.jit
def _prefetch_lines(w_ptr, pid, nprog, n_bytes, LINES: tl.constexpr, BULK: tl.constexpr):
    # each program: chunks of LINES*CH bytes; one prefetch instruction a thread-element
    if BULK:
        CH: tl.constexpr = 16384
    else:
        CH: tl.constexpr = 128
    span = LINES * CH
    for base in range(pid * span, n_bytes, nprog * span):
        offs = base + tl.arange(0, LINES) * CH
        p = (w_ptr.to(tl.pointer_type(tl.int8)) + offs)
        ok = offs < n_bytes
        p = tl.where(ok, p, w_ptr.to(tl.pointer_type(tl.int8)))
        if BULK:
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 16384; mov.u32 $0, 0;", "=r,l",
                                      [p], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                      [p], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(x_ptr, w_ptr, n_iter, n_bytes, n_pref, LINES: tl.constexpr, BULK: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 0:
        x = tl.load(x_ptr + tl.arange(0, 32))
        for i in range(n_iter):
            x = x * 1.0001 + 0.5
        tl.store(x_ptr + tl.arange(0, 32), x)
    else:
        _prefetch_lines(w_ptr, pid - 1, n_pref, n_bytes, LINES, BULK)


@triton.jit
def _pref_kernel(w_ptr, n_bytes, LINES: tl.constexpr, BULK: tl.constexpr):
    _prefetch_lines(w_ptr, tl.program_id(0), tl.num_programs(0), n_bytes, LINES, BULK)


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    res = {}
    x32 = torch.zeros(32, device=dev)
    for name, (n, k) in {"o_proj": (4096, 4096), "qkv": (6144, 4096), "down_half": (4096, 6144)}.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) for _ in range(24)]
        xs = torch.randn(1, k, device=dev, dtype=dt)
        tile = sg.tile(n, k)
        gemm = lambda w: sg.launch(xs, w, *tile)
        nb = n * k * 2
        r = {}
        r["gemm_alone"] = graph_us([lambda w=w: gemm(w) for w in ws])
        for iters in (0, 2500):
            spin0 = lambda w, P=0, bulk=False: _spin_kernel[(1 + P,)](x32, w, iters, nb, max(P, 1), LINES=128, BULK=bulk, num_warps=4)
            r[f"spin{iters}"] = graph_us([lambda w=w: spin0(w) for w in ws])
            r[f"spin{iters}+gemm"] = graph_us([c for w in ws for c in (lambda w=w: spin0(w), lambda w=w: gemm(w))]) * 2
            for bulk in (False, True):
                for P in (32, 128):
                    key = f"spin{iters}[pref{P}{'b' if bulk else 'l'}]+gemm"
                    r[key] = graph_us([c for w in ws for c in (lambda w=w, P=P, bulk=bulk: spin0(w, P, bulk),
                                                              lambda w=w: gemm(w))]) * 2
                    key = f"pref{P}{'b' if bulk else 'l'};spin{iters}+gemm"
                    r[key] = graph_us([c for w in ws for c in (
                        lambda w=w, P=P, bulk=bulk: _pref_kernel[(P,)](w, nb, LINES=128, BULK=bulk, num_warps=4),
                        lambda w=w: spin0(w), lambda w=w: gemm(w))]) * 3
        res[name] = r
        print(name, json.dumps({k2: round(v, 2) for k2, v in r.items()}), flush=True)
        del ws
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "l2_prefetch.json"), "w"), indent=1)


if __name__ == "__main__":
    main()

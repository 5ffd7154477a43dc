"""How fast one kernel can read a weight-sized buffer, by size, in a chain like a decode step's.

    python -m flashpd.bench.read_ramp --sizes-mb 8,16,33.5,50,100,201,1245 --out bench/results/read_ramp.json

At batch 1 a Qwen3-8B step's projections read 15.1 GB in 145 kernels of 33.5-201 MB each (and the LM head's 1.2 GB),
and the small ones run well below the copy rate (docs/results.md, issue 23). This separates what any kernel pays to
read that many bytes from what the few-row GEMM adds: a plain read kernel (each program sums a contiguous span of
the buffer in fp32 and writes one partial) over `--copies` distinct buffers of each size, launched back to back in a
CUDA graph with the engine's programmatic dependent launch (wait at the top, let the next kernel launch after the
loop: the few-row GEMM's form), timed per call; and beside it the few-row GEMM (engine/skinny_gemm.py, one row) over
distinct weights of the step's shapes. GB/s counts bytes read once; the copy rate (bench/common.py) is read and
written bytes over time, the figure the issue's floors use. If the read kernel at 33.5 MB is as far below the copy
rate as o_proj is, the loss belongs to a kernel of that size, not to the GEMM.
"""
from __future__ import annotations

import argparse

import torch

from flashpd.bench.attn_micro import graph_time
from flashpd.bench.common import command_line, git_revision, kernel_bench_start, machine, write_json
from flashpd.engine import skinny_gemm, triton_env
from flashpd.engine.triton_env import INTERPRET, tl, triton  # noqa: F401 (INTERPRET: tests/_interpreted.py)

if triton is not None:
    from flashpd.engine.triton_env import pdl_release, pdl_wait

    @triton.jit
    def _read_kernel(src_ptr, out_ptr, n, span, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program p sums src[p * span: (p + 1) * span] (bounded by n) in fp32 into out[p]."""
        pid = tl.program_id(0)
        pdl_wait(PDL)
        start = pid.to(tl.int64) * span
        acc = tl.zeros([BLOCK], tl.float32)
        for off in range(0, span, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            acc += tl.load(src_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
        pdl_release(PDL)
        tl.store(out_ptr + pid, tl.sum(acc, 0))


def available() -> bool:
    return triton is not None


def read_sum(src: torch.Tensor, out: torch.Tensor, block: int, warps: int, stages: int) -> None:
    """One read of src by out.numel() programs (out: fp32 partials, one a program, over spans of whole blocks)."""
    n = src.numel()
    span = spans(n, out.numel(), block)
    _read_kernel[(out.numel(),)](src, out, n, span, BLOCK=block, num_warps=warps, num_stages=stages,
                              **triton_env.pdl_args(src.device))


def spans(n: int, programs: int, block: int) -> int:
    """Elements a program reads: n over the programs, rounded up to whole blocks (the last spans may be short)."""
    per = -(-n // programs)
    return -(-per // block) * block


GEMV_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", default="8,16,33.5,50,100,201,1245", help="buffer sizes, MB (1e6 bytes)")
    ap.add_argument("--copies", type=int, default=36, help="distinct buffers a size, cycled through by the graph "
                    "(fewer where they would pass --max-gb)")
    ap.add_argument("--max-gb", type=float, default=24.0)
    ap.add_argument("--programs-per-sm", default="2,4,8")
    ap.add_argument("--block", type=int, default=2048, help="elements a program loads an iteration")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--out", default="bench/results/read_ramp.json")
    a = ap.parse_args()
    dev, sms, copy = kernel_bench_start("read_ramp")
    rows = []
    for mb in (float(s) for s in a.sizes_mb.split(",")):
        n = int(mb * 1e6) // 2
        copies = max(2, min(a.copies, int(a.max_gb * 1e9 // (2 * n))))
        bufs = [torch.empty(n, dtype=torch.bfloat16, device=dev).normal_() for _ in range(copies)]
        for pps in (int(p) for p in a.programs_per_sm.split(",")):
            out = torch.empty(sms * pps, dtype=torch.float32, device=dev)
            i = [0]

            def call() -> None:
                read_sum(bufs[i[0] % copies], out, a.block, a.warps, a.stages)
                i[0] += 1

            us = graph_time(call, reps=max(5, 200 // copies), inner=copies)
            gbs = 2 * n / (us * 1e-6) / 1e9
            rows.append({"kind": "read", "mb": mb, "copies": copies, "programs": sms * pps, "us_per_call": us,
                         "gb_per_s": gbs, "of_copy_rate": gbs / copy["gb_per_s"]})
            print(f"read {mb:>7.1f} MB x{copies}, {sms * pps} programs: {us:8.2f} us a call, {gbs:6.0f} GB/s "
                  f"({gbs / copy['gb_per_s']:.2f} of the copy rate)", flush=True)
        del bufs
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
    for name, (nr, k) in GEMV_SHAPES.items():
        w_bytes = nr * k * 2
        copies = max(2, min(a.copies, int(a.max_gb * 1e9 // w_bytes)))
        ws = [torch.randn(nr, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
        xk = x if k == 4096 else torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        tile = skinny_gemm.tile(nr, k)
        i = [0]

        def gemv() -> None:
            skinny_gemm.launch(xk, ws[i[0] % copies], *tile)
            i[0] += 1

        us = graph_time(gemv, reps=max(5, 200 // copies), inner=copies)
        gbs = w_bytes / (us * 1e-6) / 1e9
        rows.append({"kind": "gemv", "shape": name, "mb": w_bytes / 1e6, "copies": copies, "tile": list(tile),
                     "us_per_call": us, "gb_per_s": gbs, "of_copy_rate": gbs / copy["gb_per_s"]})
        print(f"gemv {name:>7} {w_bytes / 1e6:7.1f} MB x{copies}: {us:8.2f} us a call, {gbs:6.0f} GB/s "
              f"({gbs / copy['gb_per_s']:.2f} of the copy rate)", flush=True)
        del ws
    write_json(a.out, {"bench": "read_ramp", "git": git_revision(), "machine": machine(), "command": command_line("flashpd.bench.read_ramp"),
                       "copy_bandwidth": copy, "pdl": triton_env.pdl(dev), "rows": rows})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""Where a DFlash device-loop step's time goes, kernel by kernel: the draft pass against the verify.

    python -m flashpd.bench.step_trace --draft-vocabs 0,16384 --out bench/results/step_trace.json

The Qwen3-8B shape with dummy weights (as bench/speed_8b.py), batch 1, one captured step replayed under the profiler.
A step's kernels in launch order: the draft pass (context rows, five layers, head, argmax) ends at the first argmax
merge kernel; the verify and acceptance follow. For each part: its span on the GPU (first kernel's start to last
kernel's end), its busy time (kernel durations summed) and its kernels, so the draft's cost can be set against the
bytes it reads. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from flashpd.bench.common import command_line, copy_bandwidth_gbs, write_json

SPLIT_KERNEL = "_merge_kernel"  # engine/greedy_argmax.py's second kernel: the draft's argmax ends the draft pass
STEP_END = "Memcpy DtoH"  # DeviceLoop.launch copies each step's result to pinned host memory after its graph


def split_steps(kernels: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    """Device events (name, start us, end us) of whole steps -> the complete steps, one list each, in launch order.
    A step ends with the copy of its result to the host (STEP_END), which the loop issues after each graph: kernel
    names cannot mark a step's start, since compiled functions of the draft, the verify and the bookkeeping reuse
    names like triton_poi_fused_0. A piece without both argmaxes (the draft's and the verify's SPLIT_KERNEL: a step
    cut by the trace's ends) is dropped."""
    ordered = sorted(kernels, key=lambda e: e[1])
    if not ordered:
        raise ValueError("no kernels traced")
    out: list[list[tuple[str, float, float]]] = [[]]
    for k in ordered:
        out[-1].append(k)
        if k[0].startswith(STEP_END):
            out.append([])
    whole = [st for st in out if sum(SPLIT_KERNEL in n for n, _, _ in st) == 2 and st[-1][0].startswith(STEP_END)]
    if not whole:
        raise ValueError(f"no whole step (two {SPLIT_KERNEL}s, then {STEP_END}) among {len(out)} pieces of the trace")
    return whole


def parts(step: list[tuple[str, float, float]]) -> dict:
    """One step's kernels -> the draft part (through the first SPLIT_KERNEL) and the rest (verify, accept): each
    part's span and busy time in ms, its kernel count and its kernels (name, offset from the step's start, us)."""
    cut = next((i for i, (name, _, _) in enumerate(step) if SPLIT_KERNEL in name), None)
    if cut is None:
        raise ValueError(f"no {SPLIT_KERNEL} in the step: not a DFlash step with the argmax kernels")
    t0 = step[0][1]

    def summary(ks: list[tuple[str, float, float]]) -> dict:
        return {"span_ms": (ks[-1][2] - ks[0][1]) / 1e3, "busy_ms": sum(e - s for _, s, e in ks) / 1e3,
                "kernels": len(ks),
                "list": [{"name": n[:80], "start_us": round(s - t0, 2), "us": round(e - s, 2)} for n, s, e in ks]}

    return {"step_span_ms": (step[-1][2] - t0) / 1e3, "draft": summary(step[:cut + 1]),
            "verify": summary(step[cut + 1:]),
            "gap_ms": (step[cut + 1][1] - step[cut][2]) / 1e3 if cut + 1 < len(step) else 0.0}


def main() -> None:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    from flashpd.bench.dflash_step import drafter_config_for  # noqa: PLC0415
    from flashpd.bench.speed_8b import random_prompts, ready, run_steps  # noqa: PLC0415
    from flashpd.engine.config import builtin_config_path, load_config  # noqa: PLC0415
    from flashpd.engine.drafter import dummy_drafter  # noqa: PLC0415
    from flashpd.engine.loader import dummy_target  # noqa: PLC0415
    from flashpd.engine.runner import ModelRunner, RunnerConfig  # noqa: PLC0415
    from flashpd.engine.spec_decode import DFlashGenerator  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8, help="steps profiled (after 8 untimed)")
    ap.add_argument("--draft-vocabs", default="0", help="hot-id counts to trace (0: the whole head)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/step_trace.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_trace needs a CUDA GPU")
    cfg = load_config(builtin_config_path(a.config))
    target = dummy_target(cfg, "cuda", torch.bfloat16)
    drafter = dummy_drafter(drafter_config_for(cfg, 5), target)
    budget = (2 * a.steps + 24) * a.width
    runner = ModelRunner(target, num_blocks=(a.context + budget) // 16 + 64, kv_block_size=16,
                         taps=tuple(drafter.cfg.target_layer_ids), config=RunnerConfig())
    rate = copy_bandwidth_gbs()
    res: dict = {"bench": "step_trace", "config": a.config, "dtype": "bfloat16", "weights": "dummy",
                 "copy_bandwidth": rate, "command": command_line("flashpd.bench.step_trace"), "runs": []}
    layer_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
    for n in [int(x) for x in a.draft_vocabs.split(",") if x]:
        hot = None if n == 0 else torch.sort(torch.randperm(cfg.vocab_size, generator=torch.Generator()
                                                            .manual_seed(a.seed))[:n]).values
        drafter.set_token_map(hot)
        gen = DFlashGenerator(runner, drafter, ())
        seqs = ready(gen, random_prompts(1, a.context, cfg.vocab_size, a.seed), budget, a.width)
        loop = gen.loop()
        sess = loop.begin(seqs)

        run_steps(loop, sess, 8)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_steps(loop, sess, a.steps)
        # kernels, copies and memsets alike: each is device time in the step (a graph's copy nodes included)
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start]
        whole = split_steps(kernels)
        steps = [parts(s) for s in whole]
        starts = [st[0][1] for st in whole]  # a step's period: its span plus the launch gap to the next
        head_bytes = drafter.head_weight.numel() * drafter.head_weight.element_size()
        draft_bytes = layer_bytes + head_bytes
        row = {"draft_vocab": n, "draft_bytes": draft_bytes,
               "draft_span_ms": statistics.median(s["draft"]["span_ms"] for s in steps),
               "draft_busy_ms": statistics.median(s["draft"]["busy_ms"] for s in steps),
               "verify_span_ms": statistics.median(s["verify"]["span_ms"] for s in steps),
               "verify_busy_ms": statistics.median(s["verify"]["busy_ms"] for s in steps),
               "step_span_ms": statistics.median(s["step_span_ms"] for s in steps),
               "step_period_ms": statistics.median(b - a for a, b in zip(starts, starts[1:])) / 1e3
               if len(starts) > 1 else None,
               "steps_launched": a.steps, "steps_found": len(steps),
               "kernels_per_step": sorted({s["draft"]["kernels"] + s["verify"]["kernels"] for s in steps}),
               "draft_kernels": steps[0]["draft"]["kernels"], "verify_kernels": steps[0]["verify"]["kernels"],
               "one_step": steps[len(steps) // 2]}
        row["draft_copy_fraction"] = draft_bytes / (row["draft_span_ms"] * 1e-3) / (rate["gb_per_s"] * 1e9)
        res["runs"].append(row)
        print(f"[step_trace {time.strftime('%H:%M:%S')}] draft vocabulary {n or 'full'}: step {row['step_span_ms']:.3f} "
              f"ms; draft {row['draft_span_ms']:.3f} ms span / {row['draft_busy_ms']:.3f} busy, {row['draft_kernels']} "
              f"kernels, {draft_bytes / 1e9:.2f} GB at {row['draft_copy_fraction']:.2f} of the copy rate; verify "
              f"{row['verify_span_ms']:.3f} / {row['verify_busy_ms']:.3f}, {row['verify_kernels']} kernels; "
              f"{row['steps_found']} whole steps of {row['kernels_per_step']} kernels", flush=True)
        loop.end(sess)
        for s in seqs:
            runner.allocator.free(s.table)
        write_json(Path(a.out), res)
    drafter.set_token_map(None)


if __name__ == "__main__":
    main()

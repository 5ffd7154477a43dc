"""Where a decode step's time goes: wall time vs GPU-busy time, kernel count, top kernels and host ops,
for a native step and a DFlash step of the demo pair (or any pair) at batch 1.

    python -m flashpd.bench.profile_step --out bench/results/profile_step_h200.json

It also times whole requests in the device loop (engine/device_loop.py), per step and without the
profiler: there the host runs one step behind the GPU, which is what a greedy `generate` uses.
A step whose wall time far exceeds its GPU-busy time is host-bound (Python, launches, syncs, copies).
On a CPU it runs too (a crash check; the split means little there). DFlash steps run at the drafter's block
width (`dflash_block`); until this was fixed they ran at width 1 (see the README's profile table).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashpd.bench.common import write_json
from flashpd.demo import PAIR
from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator


def _ready(gen: NativeGenerator, prompt: list[int], max_tokens: int):
    seqs = gen.new_sequences([prompt], [SamplingParams(max_tokens=max_tokens, ignore_eos=True)])
    spec = isinstance(gen, DFlashGenerator)
    if spec:  # new_sequences leaves width 1 (native); DFlash's generate sets the draft width: so must this
        for s in seqs:
            s.draft_width = gen.draft_width
    gen.reserve(seqs)
    gen.prefill_request(seqs)
    return seqs


def measure(gen: NativeGenerator, step, prompt: list[int], steps: int, cuda: bool) -> dict:
    seqs = _ready(gen, prompt, 16 * (2 * steps + 8))
    for _ in range(5):  # captures / compiles this shape
        step(seqs)
    walls = []
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            t = time.perf_counter()
            step(seqs)
            walls.append((time.perf_counter() - t) * 1e3)
    for s in seqs:
        gen.finish(s)
    ev = prof.key_averages()
    kernels = [e for e in ev if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    gpu_us = sum(getattr(e, "self_device_time_total", 0.0) for e in kernels)
    n_kernels = sum(e.count for e in kernels)
    top_k = sorted(kernels, key=lambda e: -getattr(e, "self_device_time_total", 0.0))[:12]
    host = sorted([e for e in ev if e not in kernels], key=lambda e: -e.self_cpu_time_total)[:15]
    return {"wall_ms_median": statistics.median(walls), "wall_ms": walls,
            "gpu_busy_ms_per_step": gpu_us / 1e3 / steps if cuda else None,
            "kernels_per_step": n_kernels / steps if cuda else None,
            "top_kernels": [{"name": e.key[:120], "ms_per_step": getattr(e, "self_device_time_total", 0.0) / 1e3 / steps,
                             "calls_per_step": e.count / steps} for e in top_k],
            "top_host_ops": [{"name": e.key[:120], "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                              "calls_per_step": e.count / steps} for e in host]}


def kernel_table(prof, steps: int) -> tuple[float, float, list[dict]]:
    """(GPU-busy ms per step, kernels per step, every kernel's ms and calls per step, costliest first)."""
    ev = prof.key_averages()
    kernels = [e for e in ev if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    gpu_us = sum(getattr(e, "self_device_time_total", 0.0) for e in kernels)
    table = [{"name": e.key[:120], "ms_per_step": getattr(e, "self_device_time_total", 0.0) / 1e3 / steps,
              "calls_per_step": e.count / steps}
             for e in sorted(kernels, key=lambda e: -getattr(e, "self_device_time_total", 0.0))]
    return gpu_us / 1e3 / steps, sum(e.count for e in kernels) / steps, table


def measure_loop(gen: NativeGenerator, prompt: list[int], max_tokens: int, reps: int, cuda: bool) -> dict:
    """Wall time per step of whole requests in the device loop (engine/device_loop.py), no profiler:
    the host is one step behind the device there, so a step's cost is the loop's time over its steps.
    On a GPU one more request runs under the profiler: the kernels its graph replays, per step (what a
    step is made of in the path `generate` takes, where the stepwise rows above time another path)."""
    per_step, steps, tau = [], 0, None
    out: dict = {}
    if cuda:
        seqs = _ready(gen, prompt, max_tokens)
        gen.run_on_device(seqs)  # captures this shape outside the profile
        gen.finish(seqs[0])
        seqs = _ready(gen, prompt, max_tokens)
        wasted = gen.loop().wasted_steps
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen.run_on_device(seqs)
            torch.cuda.synchronize()
        s = seqs[0]
        n = (len(s.stats.acceptance_lengths) or len(s.output) - 1) + gen.loop().wasted_steps - wasted
        gpu, kern, table = kernel_table(prof, n)
        gen.finish(s)
        out = {"gpu_busy_ms_per_step": gpu, "kernels_per_step": kern, "kernels": table}
    for r in range(reps + 1):  # the first run captures this shape
        seqs = _ready(gen, prompt, max_tokens)
        torch.cuda.synchronize() if cuda else None
        t = time.perf_counter()
        assert gen.run_on_device(seqs), "the device loop did not take this request"
        torch.cuda.synchronize() if cuda else None
        dt = (time.perf_counter() - t) * 1e3
        s = seqs[0]
        steps = len(s.stats.acceptance_lengths) or len(s.output) - 1
        tau = s.stats.tau if s.stats.acceptance_lengths else None
        gen.finish(s)
        if r:
            per_step.append(dt / steps)
    return {"wall_ms_per_step_median": statistics.median(per_step), "wall_ms_per_step": per_step, "steps": steps,
            "tau": tau, **out}


def measure_prefill(gen: NativeGenerator, prompt: list[int], reps: int, cuda: bool) -> float:
    """Median ms from a prompt to its first token, the drafter's context written too for DFlash (what
    a request waits for before its first step; `_ready` writes it)."""
    times = []
    for r in range(reps + 1):  # the first run captures / compiles
        torch.cuda.synchronize() if cuda else None
        t = time.perf_counter()
        seqs = _ready(gen, prompt, 1)
        torch.cuda.synchronize() if cuda else None
        if r:
            times.append((time.perf_counter() - t) * 1e3)
        gen.finish(seqs[0])
    return statistics.median(times)


def prefill_rows(runner: ModelRunner, gens: dict[str, NativeGenerator], prompts: dict[int, list[int]], reps: int,
                 cuda: bool) -> list[dict]:
    """Prefill time per prompt length with the fresh-prefill causal kernel on and off, and long prompts
    chunked to graph width or run as one eager forward: what each choice costs a long prompt's TTFT."""
    rows = []
    chunk0 = runner.config.prefill_chunk
    for n, prompt in prompts.items():
        for fresh in (True, False):
            for chunk in ((chunk0, None) if chunk0 and n > chunk0 else (chunk0,)):
                runner.reconfigure(fresh_prefill=fresh, prefill_chunk=chunk)
                row = {"prompt_len": n, "fresh": fresh, "chunk": chunk}
                row.update({f"{k}_ms": measure_prefill(g, prompt, reps, cuda) for k, g in gens.items()})
                rows.append(row)
                print(f"prefill {n} tokens, fresh {fresh}, chunk {chunk}: "
                      + ", ".join(f"{k} {row[k + '_ms']:.2f} ms" for k in gens), flush=True)
    runner.reconfigure(fresh_prefill=True, prefill_chunk=chunk0)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(PAIR / "target"))
    ap.add_argument("--draft", default=str(PAIR / "drafter"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", default="256,2048")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--loop-tokens", type=int, default=200, help="tokens per request of the device-loop rows")
    ap.add_argument("--prompts", choices=["random", "heldout"], default="random",
                    help="random ids (the drafter accepts about nothing: a step's floor) or windows of held-out "
                         "text (steps at the pair's real acceptance)")
    ap.add_argument("--block", type=int, default=16, help="DFlash block width of the steps timed")
    ap.add_argument("--prefill-lens", default="256,1024,2048",
                    help="prompt lengths of the prefill rows (empty: none)")
    ap.add_argument("--out", default="bench/results/profile_step.json")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    target = load_target(a.target, a.device, torch.bfloat16 if cuda else torch.float32)
    drafter = load_drafter(a.draft, target)
    runner = ModelRunner(target, 4096, 16, taps=tuple(drafter.cfg.target_layer_ids))
    native, spec = NativeGenerator(runner), DFlashGenerator(runner, drafter, (), a.block)
    g = torch.Generator().manual_seed(0)

    def make_prompt(n: int) -> list[int]:
        if a.prompts == "heldout":
            from tokenizers import Tokenizer  # noqa: PLC0415

            from flashpd.training.demo_recipe import heldout_long_prompts  # noqa: PLC0415
            return heldout_long_prompts(Tokenizer.from_file(f"{a.target}/tokenizer.json"), 1, n)[0]
        return torch.randint(2, target.cfg.vocab_size - 2, (n,), generator=g).tolist()

    rows = []
    for n in (int(x) for x in a.contexts.split(",")):
        prompt = make_prompt(n)
        row = {"context": n, "native": measure(native, native.decode_step, prompt, a.steps, cuda),
               "dflash": measure(spec, spec.spec_step, prompt, a.steps, cuda)}
        row["native_device_loop"] = measure_loop(native, prompt, a.loop_tokens, 5, cuda)
        row["dflash_device_loop"] = measure_loop(spec, prompt, a.loop_tokens, 5, cuda)
        nat, dfl = row["native"], row["dflash"]
        nl, dl = row["native_device_loop"], row["dflash_device_loop"]
        print(f"context {n}, device loop: native {nl['wall_ms_per_step_median']:.3f} ms per step, dflash "
              f"{dl['wall_ms_per_step_median']:.3f} ms per step ({dl['steps']} steps)", flush=True)
        if cuda:
            print(f"  device-loop kernels per step: native {nl['kernels_per_step']:.1f} "
                  f"({nl['gpu_busy_ms_per_step']:.3f} ms GPU), dflash {dl['kernels_per_step']:.1f} "
                  f"({dl['gpu_busy_ms_per_step']:.3f} ms GPU)", flush=True)
        row["dflash_over_native_wall"] = dfl["wall_ms_median"] / nat["wall_ms_median"]
        if cuda:
            row["dflash_over_native_gpu_busy"] = dfl["gpu_busy_ms_per_step"] / nat["gpu_busy_ms_per_step"]
        rows.append(row)
        print(f"context {n}: native {nat['wall_ms_median']:.3f} ms wall"
              + (f" / {nat['gpu_busy_ms_per_step']:.3f} ms GPU ({nat['kernels_per_step']:.0f} kernels)" if cuda else "")
              + f"; dflash {dfl['wall_ms_median']:.3f} ms wall"
              + (f" / {dfl['gpu_busy_ms_per_step']:.3f} ms GPU ({dfl['kernels_per_step']:.0f} kernels)" if cuda else ""),
              flush=True)
    lens = [int(x) for x in a.prefill_lens.split(",") if x]
    prefill = prefill_rows(runner, {"native": native, "dflash": spec}, {n: make_prompt(n) for n in lens}, 5, cuda)
    write_json(Path(a.out), {"bench": "profile_step", "target": a.target, "draft": a.draft, "device": a.device,
                             "batch": 1, "steps": a.steps, "prompts": a.prompts, "dflash_block": spec.draft_width,
                             "rows": rows, "prefill": prefill,
                             "command": f"python -m flashpd.bench.profile_step --contexts {a.contexts} --steps {a.steps} "
                                        f"--loop-tokens {a.loop_tokens} --prompts {a.prompts} --block {a.block} "
                                        f"--prefill-lens {a.prefill_lens} --out {a.out}"})


if __name__ == "__main__":
    main()

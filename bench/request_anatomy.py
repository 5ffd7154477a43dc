"""Where a whole greedy request's time goes outside its steps, native and DFlash, batch 1.

    python -m flashpd.bench.request_anatomy --out bench/results/request_anatomy.json

A request's latency is its steps plus a fixed part (sequence setup, prefill and first token, the device
loop's start and end, finish). The fixed part is paid once by both methods, so the fewer steps DFlash
takes, the larger its share of DFlash's time: it caps the speedup of prompts the drafter does well on.
Each phase here is timed with a device sync at its end, over `--reps` runs of the protocol's
confirmation prompts (bench/speedup.py's held-out sets): the sequential path (prefill and first token,
then the device loop's start), which `generate` took until it queued the first step behind the prefill
(NativeGenerator.start). The whole `generate` is timed beside it, as the protocol times it, and again right after a request of the other method (as the protocol interleaves them).
With `--trace DIR`, a DFlash request right after a native one and one right after another DFlash request
are saved as gzipped Chrome traces.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

import torch

from flashpd.bench.common import write_json
from flashpd.bench.speedup import _timed, heldout_prompt_sets, pair_generators
from flashpd.demo import PAIR
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.engine.tokenizer import TextTokenizer
from flashpd.engine.scheduler import generate


def _sync(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def phases(gen: NativeGenerator, prompt: list[int], new_tokens: int, width: int | None, cuda: bool) -> dict:
    """One request, phase by phase (ms), the calls the scheduler makes for it (engine/scheduler.py; prefill and
    the loop's begin as two phases here), a sync after each phase."""
    params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True)]
    spec = isinstance(gen, DFlashGenerator)
    t0 = _sync(cuda)
    seqs = gen.new_sequences([prompt], params)
    if spec:
        seqs[0].draft_width = width
    gen.reserve(seqs)
    t1 = _sync(cuda)
    gen.prefill_request(seqs)
    t2 = _sync(cuda)
    loop = gen.loop()
    sess = loop.begin(seqs)
    t3 = _sync(cuda)
    wasted = loop.wasted_steps
    loop.step_to_end(sess)  # DeviceLoop.run after its begin (its end too: tens of microseconds)
    t4 = _sync(cuda)
    for s in seqs:
        gen.finish(s)  # every row is done: publish nothing, free the blocks
    t5 = _sync(cuda)
    s = seqs[0]
    steps = len(s.stats.acceptance_lengths) if spec else len(s.output) - 1
    ms = lambda a, b: (b - a) * 1e3  # noqa: E731
    return {"setup_ms": ms(t0, t1), "prefill_first_token_ms": ms(t1, t2), "loop_begin_ms": ms(t2, t3),
            "steps_ms": ms(t3, t4), "finish_ms": ms(t4, t5), "total_ms": ms(t0, t5),
            "steps": steps, "wasted_steps": loop.wasted_steps - wasted, "step_ms": ms(t3, t4) / max(steps, 1)}


def whole(gen: NativeGenerator, prompt: list[int], new_tokens: int, width: int | None) -> float:
    """The whole `generate`, timed as the protocol times it (bench/speedup.py)."""
    params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True)]
    if isinstance(gen, DFlashGenerator):
        return _timed(lambda: generate(gen, [prompt], params, [width]))[0]
    return _timed(lambda: generate(gen, [prompt], params))[0]


def trace(gen: NativeGenerator, prompt: list[int], new_tokens: int, width: int | None, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        whole(gen, prompt, new_tokens, width)
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    trace_json = json.loads(raw.read_text())
    trace_json["traceName"] = raw.name  # the file's name, not the machine's path to it
    with gzip.open(path, "wt") as g:
        json.dump(trace_json, g)
    raw.unlink()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(PAIR / "target"), help="default: the installed package's demo pair")
    ap.add_argument("--draft", default=str(PAIR / "drafter"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=8, help="per set, as in bench/speedup.py (confirmation set used)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", default="", help="folder for gzipped Chrome traces of one request each")
    ap.add_argument("--trace-prompt", type=int, default=3)
    ap.add_argument("--out", default="bench/results/request_anatomy.json")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    _, native, spec = pair_generators(a.target, a.draft, a.device)
    _, confirm = heldout_prompt_sets(TextTokenizer.from_dir(a.target), a.prompts, a.seed)
    rows = []
    for i, p in enumerate(confirm):
        row = {"prompt": i, "prompt_len": len(p)}
        for name, gen, w in (("native", native, None), ("dflash", spec, a.width)):
            whole(gen, p, a.new_tokens, w)  # warm-up: captures this prompt's shapes
            runs = [phases(gen, p, a.new_tokens, w, cuda) for _ in range(a.reps)]
            row[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            row[name]["generate_ms"] = statistics.median(whole(gen, p, a.new_tokens, w) for _ in range(a.reps))
            other, ow = (spec, a.width) if gen is native else (native, None)
            after = []
            for _ in range(a.reps):  # as the protocol times it: right after a request of the other method
                whole(other, p, a.new_tokens, ow)
                after.append(whole(gen, p, a.new_tokens, w))
            row[name]["generate_after_other_ms"] = statistics.median(after)
            d = row[name]
            print(f"prompt {i} ({len(p)} tok) {name:6s}: generate {d['generate_ms']:6.2f} ms = setup "
                  f"{d['setup_ms']:.2f} + prefill {d['prefill_first_token_ms']:.2f} + begin {d['loop_begin_ms']:.2f} + "
                  f"{d['steps']:.0f} steps {d['steps_ms']:.2f} ({d['step_ms']:.3f}/step, with the loop's end) "
                  f"+ finish {d['finish_ms']:.2f} (phased total {d['total_ms']:.2f}); after the other method "
                  f"{d['generate_after_other_ms']:.2f} ms", flush=True)
        rows.append(row)
    if a.trace and cuda:
        folder = Path(a.trace)
        folder.mkdir(parents=True, exist_ok=True)
        p = confirm[a.trace_prompt]
        whole(native, p, a.new_tokens, None)
        trace(spec, p, a.new_tokens, a.width, folder / "trace_dflash_after_native.json.gz")
        trace(spec, p, a.new_tokens, a.width, folder / "trace_dflash_after_dflash.json.gz")
    write_json(Path(a.out), {"bench": "request_anatomy", "target": a.target, "draft": a.draft, "device": a.device,
                             "batch": 1, "new_tokens": a.new_tokens, "width": a.width, "reps": a.reps, "rows": rows,
                             "command": f"python -m flashpd.bench.request_anatomy --prompts {a.prompts} --new-tokens "
                                        f"{a.new_tokens} --width {a.width} --reps {a.reps} --seed {a.seed} --out {a.out}"})


if __name__ == "__main__":
    main()

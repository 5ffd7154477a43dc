"""Sampled requests in the device loop's sessions against the stepwise loop: time, tokens/s, tau, agreement.

    python -m flashpd.bench.sampled_loop --target DIR --draft DIR --batches 1,8,32 --new-tokens 128 \
        --reps 3 --out bench/results/sampled_loop.json

The same sampled batch runs both ways on one runner: `device_loop` on (the default: one session of many
steps, the host reading step k while the GPU runs step k+1) and off (`NativeGenerator.device_loop = False`:
every step read before the next is launched, what a changing serving batch runs). Since the one step path
both ways run the same captured device step; before it (e0bb4b5 and earlier) "off" was the two-pass host
step (sampled rows drew on the host). Per method (native, DFlash at the drafter's width), batch size and
sampling setting ("greedy"; "plain": temperature only; "filtered": with top-p, which sorts the vocabulary), it reports
the median of `reps` timed `generate` calls after one warm-up, generated tokens per second, tau (DFlash:
tokens per target step), and how many rows give the same tokens both ways (the draws are the same on both
paths; in bf16 a logit can still round differently where the kernels' shapes differ, and part two samples).
Prompts: held-out text of the demo pair's recipe (bench/speedup.py), 64-1,024 tokens. The JSON is rewritten
after every row, so a run cut by its time limit keeps the rows it finished.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from flashpd.bench.common import git_revision, machine, write_json
from flashpd.bench.speedup import _timed, heldout_prompt_sets, pair_generators
from flashpd.demo import PAIR
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate
from flashpd.engine.tokenizer import TextTokenizer

SETTINGS = {"greedy": dict(temperature=0.0), "plain": dict(temperature=0.8),
            "filtered": dict(temperature=0.8, top_p=0.95)}


def run_case(gen: NativeGenerator, prompts: list[list[int]], params: list[SamplingParams], reps: int) -> dict:
    """Both paths on one batch: median time, tokens/s, tau, and the outputs of the last run."""
    out = {}
    for path, on in (("device_loop", True), ("stepwise", False)):  # stepwise: sessions of one step
        gen.device_loop = on
        generate(gen, prompts, params)  # warm-up: graphs and compiled kernels for these shapes
        times, seqs = [], None
        for _ in range(reps):
            ms, seqs = _timed(lambda: generate(gen, prompts, params))
            times.append(ms)
        ms = statistics.median(times)
        tokens = sum(len(s.output) for s in seqs)
        acc = [a for s in seqs for a in s.stats.acceptance_lengths]
        out[path] = {"ms": ms, "ms_all": times, "tokens": tokens, "tokens_per_s": tokens / ms * 1e3,
                     "tau": sum(acc) / len(acc) if acc else None, "outputs": [s.output for s in seqs]}
    gen.device_loop = True
    a, b = out["device_loop"].pop("outputs"), out["stepwise"].pop("outputs")
    out["rows_equal"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
    out["device_loop_speedup"] = out["stepwise"]["ms"] / out["device_loop"]["ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(PAIR / "target"))
    ap.add_argument("--draft", default=str(PAIR / "drafter"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--settings", default="greedy,plain,filtered", help=f"of {list(SETTINGS)}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/sampled_loop.json")
    a = ap.parse_args()
    runner, native, spec = pair_generators(a.target, a.draft, a.device)
    tok = TextTokenizer.from_dir(a.target)
    batches = [int(x) for x in a.batches.split(",")]
    _, pool = heldout_prompt_sets(tok, max(batches) + 1, a.seed)
    pool = [p[:1024] for p in pool[1:]]  # the 2,000-token first prompt of the set is left out
    rows = []
    command = " ".join(["python -m flashpd.bench.sampled_loop"] +
                       [f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()])

    def save() -> None:  # after every row: a run cut by a time limit keeps what it measured
        write_json(a.out, {"bench": "sampled_loop", "command": command, "git": git_revision(), "machine": machine(),
                           "dtype": str(runner.dtype), "new_tokens": a.new_tokens, "reps": a.reps, "rows": rows})

    for setting in a.settings.split(","):
        for b in batches:
            params = [SamplingParams(max_tokens=a.new_tokens, ignore_eos=True, seed=a.seed * 1000 + i,
                                     **SETTINGS[setting]) for i in range(b)]
            for method, gen in (("native", native), ("dflash", spec)):
                r = run_case(gen, pool[:b], params, a.reps)
                rows.append({"setting": setting, "sampling": SETTINGS[setting], "batch": b, "method": method, **r})
                print(f"{setting:8s} b={b:3d} {method:6s} device loop {r['device_loop']['ms']:8.1f} ms "
                      f"({r['device_loop']['tokens_per_s']:8.0f} tok/s)  stepwise {r['stepwise']['ms']:8.1f} ms "
                      f"({r['stepwise']['tokens_per_s']:8.0f} tok/s)  x{r['device_loop_speedup']:.2f}  "
                      f"equal {r['rows_equal']}", flush=True)
                save()


if __name__ == "__main__":
    main()

"""DFlash vs native speedup under the experiment protocol (screen, then disjoint confirmation).

    python -m flashpd.bench.speedup --target DIR --draft DIR --out bench/results/speedup.json

Protocol: prompts come from held-out text (files the demo pair never trained on), split into a
SCREEN set and a DISJOINT CONFIRMATION set (different files), each with a 2,000+ token prompt.
Screen: block widths 4, 8, 12, 16, one timed run per prompt after a warm-up. Confirmation: the
screen's best width, R timed repetitions, native and DFlash interleaved in one process.
Per prompt: median of repetitions, paired speedup (native median / DFlash median). Across
prompts: geometric mean, median, min, max; never pooled. Exactness: every timed DFlash run's
ids against the native baseline's (k/n, first differing position). tau per prompt and the
acceptance rate per block position are reported beside every speedup.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from flashpd.bench.common import add_compile_args, apply_compile_args, write_json
from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.engine.tokenizer import TextTokenizer
from flashpd.training.text_data import read_texts, split_files, stdlib_files
from flashpd.engine.scheduler import generate


def heldout_prompt_sets(tok: TextTokenizer, n: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two disjoint prompt sets from the held-out files: even-indexed files screen, odd ones confirm."""
    _, held = split_files(stdlib_files())
    texts = read_texts(held)
    g = torch.Generator().manual_seed(seed)
    sets: list[list[list[int]]] = []
    for part in (texts[0::2], texts[1::2]):
        stream = [t for text in part for t in tok.encode(text)]
        lens = [2048 + 200] + [int(x) for x in torch.randint(64, 1024, (n - 1,), generator=g)]
        starts = torch.randint(0, len(stream) - max(lens) - 1, (n,), generator=g).tolist()
        sets.append([stream[s:s + k] for s, k in zip(starts, lens)])
    return sets[0], sets[1]


def pair_generators(target_dir: str, draft_dir: str, device: str, compile: bool | None = None,
                    eager_rounding: bool = False, inductor_extra: tuple = (), blas: str | None = RunnerConfig.blas
                    ) -> tuple[ModelRunner, NativeGenerator, DFlashGenerator]:
    """Native and DFlash generators of one pair on one runner (bf16 on a GPU, float32 on the CPU), so
    both methods share the cache, the graphs and the compiled kernels. eager_rounding, inductor_extra and blas:
    RunnerConfig.compile_eager_rounding, inductor_extra and blas."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = load_target(target_dir, device, dtype)
    drafter = load_drafter(draft_dir, target)
    runner = ModelRunner(target, num_blocks=8192, kv_block_size=16, taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(compile=compile, compile_eager_rounding=eager_rounding,
                                             inductor_extra=inductor_extra, blas=blas))
    return (runner, NativeGenerator(runner, target.cfg.eos_token_ids),
            DFlashGenerator(runner, drafter, target.cfg.eos_token_ids))


def _timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return (time.perf_counter() - t) * 1e3, out


def run_set(native: NativeGenerator, spec: DFlashGenerator, prompts: list[list[int]], width: int, new_tokens: int,
            reps: int) -> dict:
    params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True)]
    rows = []
    for i, p in enumerate(prompts):
        base = generate(native, [p], params)[0].output  # warm-up (and the exactness baseline)
        generate(spec, [p], params, [width])
        t_nat, t_spec, exact, first, taus, hist_acc, hist_n = [], [], 0, [], [], None, None
        for _ in range(reps):
            a, n_out = _timed(lambda: generate(native, [p], params)[0])
            b, s_out = _timed(lambda: generate(spec, [p], params, [width])[0])
            t_nat.append(a)
            t_spec.append(b)
            exact += s_out.output == base
            first.append(next((k for k, (x, y) in enumerate(zip(s_out.output, base)) if x != y), None))
            taus.append(s_out.stats.tau)
            hist_acc, hist_n = s_out.stats.position_accepts, s_out.stats.position_drafted
        m_nat, m_spec = statistics.median(t_nat), statistics.median(t_spec)
        rows.append({"prompt": i, "prompt_len": len(p), "native_ms": t_nat, "dflash_ms": t_spec,
                     "native_median_ms": m_nat, "dflash_median_ms": m_spec, "speedup": m_nat / m_spec,
                     "tau": statistics.mean(taus), "exact": f"{exact}/{reps}", "first_diff": first,
                     "position_acceptance": [a / n for a, n in zip(hist_acc, hist_n)]})
        print(f"  width {width:2d} new {new_tokens:3d} prompt {i} ({len(p):5d} tok): native {m_nat:7.1f} ms, "
              f"dflash {m_spec:7.1f} ms, x{m_nat / m_spec:5.2f}, tau {statistics.mean(taus):5.2f}, "
              f"exact {exact}/{reps}", flush=True)
    sp = [r["speedup"] for r in rows]
    return {"width": width, "new_tokens": new_tokens, "reps": reps, "prompts": rows,
            "geomean_speedup": math.exp(statistics.mean(math.log(x) for x in sp)),
            "median_speedup": statistics.median(sp), "min_speedup": min(sp), "max_speedup": max(sp),
            "tau_mean": statistics.mean(r["tau"] for r in rows),
            "exact": f"{sum(int(r['exact'].split('/')[0]) for r in rows)}/{reps * len(rows)}"}


def plot(payload: dict, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []
    screen = payload["screen"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([s["width"] for s in screen], [s["geomean_speedup"] for s in screen], "o-")
    ax.set_xlabel("block width"), ax.set_ylabel("geomean speedup (screen)"), ax.grid(alpha=.3)
    f = out.with_name(out.stem + "_width.png")
    fig.tight_layout(), fig.savefig(f, dpi=120), plt.close(fig)
    files.append(f.name)
    for conf in payload["confirm"]:
        fig, ax = plt.subplots(figsize=(6, 0.5 + 0.45 * len(conf["prompts"])))
        ys = range(len(conf["prompts"]))
        ax.barh([y + 0.2 for y in ys], [r["native_median_ms"] for r in conf["prompts"]], 0.4, label="native")
        ax.barh([y - 0.2 for y in ys], [r["dflash_median_ms"] for r in conf["prompts"]], 0.4,
                label=f"DFlash (block {conf['width']})")
        ax.set_yticks(list(ys), [f"p{r['prompt']} ({r['prompt_len']} tok) x{r['speedup']:.2f}" for r in conf["prompts"]])
        ax.set_xlabel(f"median latency, ms ({conf['new_tokens']} new tokens)"), ax.legend(fontsize=8)
        f = out.with_name(out.stem + f"_confirm_{conf['new_tokens']}.png")
        fig.tight_layout(), fig.savefig(f, dpi=120), plt.close(fig)
        files.append(f.name)
    return files


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=8, help="per set (screen and confirmation; 8 in every headline run since demo pair v2)")
    ap.add_argument("--new-tokens", default="64,256")
    ap.add_argument("--widths", default="4,8,12,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fresh-prefill", action="store_true",
                    help="prefill through the cache and the position mask, not the fused causal kernel")
    add_compile_args(ap)
    ap.add_argument("--out", default="bench/results/speedup.json")
    a = ap.parse_args()
    compile_fields, compile_flags = apply_compile_args(a)
    runner, native, spec = pair_generators(a.target, a.draft, a.device)
    dtype = runner.dtype
    screen_p, confirm_p = heldout_prompt_sets(TextTokenizer.from_dir(a.target), a.prompts, a.seed)
    runner.reconfigure(fresh_prefill=not a.no_fresh_prefill)
    news = [int(x) for x in a.new_tokens.split(",")]
    print("screen (1 timed run each):", flush=True)
    screen = [run_set(native, spec, screen_p, w, news[0], 1) for w in (int(x) for x in a.widths.split(","))]
    best = max(screen, key=lambda s: s["geomean_speedup"])["width"]
    out = Path(a.out)
    partial = {"bench": "speedup", "partial": "screen only", "screen": screen, "chosen_width": best}
    write_json(out, partial)  # a run cut short still leaves what it measured
    print(f"confirmation at width {best} ({a.reps} reps, disjoint prompts):", flush=True)
    confirm = []
    for n in news:
        confirm.append(run_set(native, spec, confirm_p, best, n, a.reps))
        write_json(out, {**partial, "partial": f"confirmed new_tokens {[c['new_tokens'] for c in confirm]}",
                         "confirm": confirm})
    payload = {"bench": "speedup", "target": a.target, "draft": a.draft, "device": a.device,
               "dtype": str(dtype).removeprefix("torch."), "batch": 1, "fresh_prefill": runner.config.fresh_prefill,
               **compile_fields,
               "screen": screen, "chosen_width": best,
               "confirm": confirm,
               "command": f"python -m flashpd.bench.speedup --target {a.target} --draft {a.draft} --prompts {a.prompts} "
                          f"--new-tokens {a.new_tokens} --widths {a.widths} --reps {a.reps} --seed {a.seed}"
                          + (" --no-fresh-prefill" if a.no_fresh_prefill else "")
                          + compile_flags + f" --out {a.out}"}
    write_json(out, payload)
    try:
        payload["charts"] = plot(payload, out)
        write_json(out, payload)
    except ImportError:
        print("matplotlib not installed: no charts")
    for c in confirm:
        print(f"confirm new {c['new_tokens']}: geomean x{c['geomean_speedup']:.3f}, median x{c['median_speedup']:.3f} "
              f"[{c['min_speedup']:.2f}, {c['max_speedup']:.2f}], tau {c['tau_mean']:.2f}, exact {c['exact']}")


if __name__ == "__main__":
    main()

"""Confidence-aware block width against fixed widths 4/8/16, side by side, under the speedup protocol.

    python -m flashpd.bench.adaptive --target DIR --draft DIR --out bench/results/adaptive_h200.json

Concurrency c here is batch size through the engine: c requests decoded as one batch by
`DFlashGenerator.generate`, all arriving together (no serving stack). A fixed width steps such a greedy
batch in the device loop; the adaptive policy (engine/width_policy.py: ConfidenceWidth) does too at batch
sizes where it does not cut, and where it cuts it runs the unfused two-pass step (its widths need the
draft on the host), dropping rows as they finish.

Protocol (bench/speedup.py's: held-out prompts, a screen set and a disjoint confirmation set from
different files). Screen, on the screen set, one timed run per group after a warm-up: every fixed width
and the confidence cut at each threshold. Unless given (--caps, --cut-from-batch), the adaptive policy's
batch rule comes from the screen: its width cap at batch >= c is the best fixed width at c, and it cuts
by confidence from the smallest screened c from which the cut beat that best fixed width at every larger
screened c too (never, if at none). Confirmation, on the disjoint set: native, the fixed widths, the
adaptive policy and the route control (the cut path with threshold 0: fixed-16 tokens through the
two-pass step, what the route itself costs), interleaved in a rotating order for R repetitions per group.
Per group: the median of the repetitions; paired ratios (fixed ms / adaptive ms: every config emits the
same tokens count, ignore_eos) and their geometric mean over groups, never pooled. "Best fixed" is the
fixed width adaptive beats least, measured in the same run. Exactness: every timed run's rows against the
native baseline's (k/n): asserted in float32 (exit 1), reported in bf16. The policy's own cost per step:
host time of confidence readback and width choice (WidthStats.policy_ms) per cutting step.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

from flashpd.bench.common import add_compile_args, apply_compile_args, write_json
from flashpd.bench.speedup import _timed, heldout_prompt_sets, pair_generators
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.engine.tokenizer import TextTokenizer
from flashpd.engine.width_policy import (ConfidenceWidth, FixedWidth, WidthPolicy, WidthStats, caps_text,
                                         parse_width_policy)
from flashpd.engine.scheduler import generate

NEVER = 1 << 30  # cut_from_batch when the screen found no batch size where the cut paid


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.mean(math.log(x) for x in xs))


def groups_of(prompts: list[list[int]], c: int, n: int) -> list[list[list[int]]]:
    """The first n groups of c consecutive prompts."""
    return [prompts[g * c:(g + 1) * c] for g in range(n)]


def run_config(spec: DFlashGenerator, native: NativeGenerator, policy: WidthPolicy | None, prompts: list[list[int]],
               params: list[SamplingParams]) -> tuple[float, list]:
    """One timed batch. The bench swaps the generator's policy between configs (one draft cache and one set of
    captured graphs for all); policy None is native."""
    if policy is None:
        return _timed(lambda: generate(native, prompts, params))
    spec.width_policy, spec.width_stats = policy, WidthStats()
    return _timed(lambda: generate(spec, prompts, params))


def measure(spec, native, configs: dict[str, WidthPolicy | None], groups: list[list[list[int]]], new_tokens: int,
            reps: int, baseline: dict[tuple, list[int]], log: str) -> dict:
    """Every config on every group: a warm-up, then `reps` timed runs in a rotating order. -> per config:
    per-group medians, tok/s, tau, exactness against native, the width policy's stats."""
    names = list(configs)
    out = {n: {"ms": [], "tok_s": [], "tau": [], "exact": [0, 0], "width": []} for n in names}
    for gi, group in enumerate(groups):
        params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True)] * len(group)
        for n in names:  # warm-up (graphs, compiled kernels) and the native baseline
            _, seqs = run_config(spec, native, configs[n], group, params)
            if configs[n] is None:
                for p, s in zip(group, seqs):
                    baseline[tuple(p)] = s.output
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(reps):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                ms, seqs = run_config(spec, native, configs[n], group, params)
                times[n].append(ms)
                ex = out[n]["exact"]
                ex[0] += sum(s.output == baseline[tuple(p)] for p, s in zip(group, seqs))
                ex[1] += len(seqs)
                if configs[n] is not None:
                    out[n]["tau"].append(statistics.mean(s.stats.tau for s in seqs if s.stats.tau is not None))
                    out[n]["width"].append(spec.width_stats.as_dict())
        for n in names:
            m = statistics.median(times[n])
            out[n]["ms"].append(m)
            out[n]["tok_s"].append(len(group) * new_tokens / (m / 1e3))
        print(f"  {log} group {gi}: " + ", ".join(f"{n} {statistics.median(times[n]):.1f} ms" for n in names), flush=True)
    for n in names:
        o = out[n]
        o["tok_s_geomean"] = geomean(o["tok_s"])
        o["tau"] = statistics.mean(o["tau"]) if o["tau"] else None
        o["exact"] = f"{o['exact'][0]}/{o['exact'][1]}"
        cut = [w for w in o.pop("width") if w["cut_steps"]]
        o["cut_steps"] = sum(w["cut_steps"] for w in cut)
        o["policy_ms_per_step"] = (sum(w["policy_ms"] for w in cut) / o["cut_steps"]) if cut else None
        o["verified_per_row_step"] = (sum(w["verified"] for w in cut) / sum(w["rows"] for w in cut)) if cut else None
    return out


def cut_over_best(screened: dict, th: float) -> float:
    """A screened batch size's cut at threshold th against its best fixed width (tok/s over tok/s)."""
    r = screened["results"]
    return r[f"cut{th}"]["tok_s_geomean"] / r[f"fixed{screened['best_fixed']}"]["tok_s_geomean"]


def _ms(x: float | None) -> str:
    return "none (no cut)" if x is None else f"{x:.3f} ms"


def paired(res: dict, a: str, b: str) -> float:
    """Geometric mean over groups of b's median ms over a's: how much faster a is than b."""
    return geomean([mb / ma for ma, mb in zip(res[a]["ms"], res[b]["ms"])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--target", required=True, help="Qwen3 target directory")
    ap.add_argument("--draft", required=True, help="DFlash drafter directory")
    ap.add_argument("--device", default=None, help="cuda when available, else cpu")
    ap.add_argument("--concurrency", default="1,8,32", help="batch sizes (requests decoded as one batch)")
    ap.add_argument("--groups", type=int, default=3, help="prompt groups per concurrency and set (paired units)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per request (ignore_eos)")
    ap.add_argument("--widths", default="4,8,16", help="the fixed widths")
    ap.add_argument("--thresholds", default="0.3,0.5,0.7", help="confidence thresholds the screen tries")
    ap.add_argument("--caps", default="auto", help="adaptive max width by batch size, e.g. 1-16/9-8/17-4; auto: screen")
    ap.add_argument("--cut-from-batch", default="auto", help="batch size from which adaptive cuts; auto: screen")
    ap.add_argument("--window", type=int, default=4, help="recent acceptance lengths that floor a row's width")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per group in the confirmation")
    ap.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    ap.add_argument("--max-prompt-len", type=int, default=None, help="truncate prompts (CPU smoke runs)")
    ap.add_argument("--no-route-control", action="store_true", help="skip the fixed-16-through-the-cut-path control")
    add_compile_args(ap)
    ap.add_argument("--out", default="bench/results/adaptive.json", help="result JSON")
    a = ap.parse_args()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    compile_fields, compile_flags = apply_compile_args(a)
    runner, native, spec = pair_generators(a.target, a.draft, device)
    block = spec.draft_width
    cs = [int(x) for x in a.concurrency.split(",")]
    widths = [int(x) for x in a.widths.split(",")]
    thresholds = [float(x) for x in a.thresholds.split(",")]
    need = a.groups * max(cs)
    screen_p, confirm_p = heldout_prompt_sets(TextTokenizer.from_dir(a.target), need, a.seed)
    if a.max_prompt_len:
        screen_p, confirm_p = ([p[:a.max_prompt_len] for p in ps] for ps in (screen_p, confirm_p))
    fixed = {f"fixed{w}": FixedWidth(w) for w in widths}
    baseline: dict[tuple, list[int]] = {}
    out = Path(a.out)
    command = (f"python -m flashpd.bench.adaptive --target {a.target} --draft {a.draft} --device {device} "
               f"--concurrency {a.concurrency} --groups {a.groups} --new-tokens {a.new_tokens} --widths {a.widths} "
               f"--thresholds {a.thresholds} --caps {a.caps} --cut-from-batch {a.cut_from_batch} --window {a.window} "
               f"--reps {a.reps} --seed {a.seed}" + (f" --max-prompt-len {a.max_prompt_len}" if a.max_prompt_len else "")
               + (" --no-route-control" if a.no_route_control else "") + compile_flags + f" --out {a.out}")
    head = {"bench": "adaptive", "target": a.target, "draft": a.draft, "device": device,
            "dtype": str(runner.dtype).removeprefix("torch."), "block_size": block, "new_tokens": a.new_tokens,
            "concurrency_means": "batch size: c requests decoded as one batch by DFlashGenerator.generate",
            **compile_fields, "command": command}

    # ---- screen: fixed widths and the cut at each threshold, on the screen set ----
    screen: dict[int, dict] = {}
    caps_given = None if a.caps == "auto" else parse_width_policy(f"confidence:caps={a.caps}").max_width_by_batch
    for c in cs:
        groups = groups_of(screen_p, c, a.groups)
        print(f"screen c={c}:", flush=True)
        res = measure(spec, native, {"native": None, **fixed}, groups, a.new_tokens, 1, baseline, f"c={c}")
        best_w = max(widths, key=lambda w: res[f"fixed{w}"]["tok_s_geomean"])
        cap = ConfidenceWidth(max_width_by_batch=caps_given).cap(c) if caps_given else best_w
        cuts = {f"cut{th}": ConfidenceWidth(th, window=a.window, cut_from_batch=1, max_width_by_batch=((1, cap),))
                for th in thresholds}  # the cut at this batch size, under the cap the adaptive policy will use
        res.update(measure(spec, native, cuts, groups, a.new_tokens, 1, baseline, f"c={c} cut"))
        screen[c] = {"results": res, "best_fixed": best_w, "cut_cap": cap}
        best_th = max(thresholds, key=lambda th: cut_over_best(screen[c], th))
        screen[c].update(best_threshold=best_th, cut_over_best_fixed=cut_over_best(screen[c], best_th))
        write_json(out, {**head, "partial": f"screened c={list(screen)}", "screen": screen})
    caps = caps_given or tuple((1 if i == 0 else c, screen[c]["best_fixed"]) for i, c in enumerate(sorted(cs)))
    if a.cut_from_batch == "auto":
        paid = [c for c in sorted(cs) if all(screen[d]["cut_over_best_fixed"] > 1.0 for d in cs if d >= c)]
        cut_from = paid[0] if paid else NEVER
    else:
        cut_from = int(a.cut_from_batch)
    cut_cs = [c for c in cs if c >= cut_from]
    # the threshold whose cut did best against the best fixed width over the batch sizes where it cuts
    threshold = max(thresholds, key=lambda th: geomean([cut_over_best(screen[c], th) for c in cut_cs])) \
        if cut_cs else thresholds[0]
    adaptive = ConfidenceWidth(threshold, window=a.window, max_width_by_batch=caps, cut_from_batch=cut_from)
    spec_text = (f"confidence:threshold={threshold},window={a.window},caps={caps_text(caps)},"
                 f"cut_from_batch={cut_from}")
    head.update(adaptive_policy=adaptive.describe(), adaptive_policy_text=spec_text)
    print(f"adaptive policy: {spec_text}", flush=True)

    # ---- confirmation: disjoint prompts, every config interleaved, R repetitions ----
    confirm: dict[int, dict] = {}
    top: dict[str, float | None] = {}
    for c in cs:
        configs = {"native": None, **fixed, "adaptive": adaptive}
        if not a.no_route_control:
            configs["route16"] = ConfidenceWidth(0.0, window=0, cut_from_batch=1, max_width_by_batch=((1, block),))
        print(f"confirm c={c} ({a.reps} reps):", flush=True)
        res = measure(spec, native, configs, groups_of(confirm_p, c, a.groups), a.new_tokens, a.reps, baseline, f"c={c}")
        ratios = {f"adaptive_over_{n}": paired(res, "adaptive", n) for n in fixed}
        best = min(fixed, key=lambda n: ratios[f"adaptive_over_{n}"])
        row = {"results": res, **ratios, "best_fixed": best, "adaptive_over_best_fixed": ratios[f"adaptive_over_{best}"],
               "adaptive_cuts": adaptive.cuts(c), "adaptive_cap": adaptive.cap(c),
               "speedup_over_native": {n: paired(res, n, "native") for n in configs if n != "native"}}
        if "route16" in res:
            row["route16_over_fixed16"] = paired(res, "route16", "fixed16") if "fixed16" in fixed else None
        confirm[c] = row
        top[f"adaptive_over_best_fixed_c{c}"] = row["adaptive_over_best_fixed"]
        if "fixed16" in fixed:
            top[f"adaptive_over_fixed16_c{c}"] = ratios["adaptive_over_fixed16"]
        write_json(out, {**head, "partial": f"confirmed c={list(confirm)}", "screen": screen, "confirm": confirm, **top})
    cost = [confirm[c]["results"]["adaptive"]["policy_ms_per_step"] for c in cs]
    route_cost = [confirm[c]["results"]["route16"]["policy_ms_per_step"] for c in cs if "route16" in confirm[c]["results"]]
    exact = {f"c{c}/{n}": r["exact"] for c in cs for n, r in confirm[c]["results"].items() if n != "native"}
    payload = {**head, "screen": screen, "confirm": confirm,
               "adaptive_over_best_fixed_c1": top.get("adaptive_over_best_fixed_c1"),
               "adaptive_over_fixed16_c32": top.get("adaptive_over_fixed16_c32"), **top,
               "policy_cost_ms_per_step": {f"c{c}": x for c, x in zip(cs, cost)},
               "policy_cost_ms_per_step_route16": route_cost,
               "policy_cost_note": "host ms per cutting step spent reading the draft's confidences and choosing "
                                   "widths (WidthStats.policy_ms); None where the policy does not cut (no cost). "
                                   "The two-pass route's own cost beside the fused step: route16_over_fixed16.",
               "exact": exact}
    write_json(out, payload)
    for c in cs:
        r = confirm[c]
        print(f"c={c}: adaptive over best fixed ({r['best_fixed']}) x{r['adaptive_over_best_fixed']:.3f}; "
              + ", ".join(f"{n} {r['results'][n]['tok_s_geomean']:.1f} tok/s tau {r['results'][n]['tau'] or 0:.2f} "
                          f"exact {r['results'][n]['exact']}" for n in r["results"] if n != "native")
              + f"; policy cost {_ms(r['results']['adaptive']['policy_ms_per_step'])} per cutting step", flush=True)
    inexact = {k: v for k, v in exact.items() if v.split("/")[0] != v.split("/")[1]}
    if inexact and runner.dtype == torch.float32:
        print(f"NOT EXACT in float32: {inexact}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

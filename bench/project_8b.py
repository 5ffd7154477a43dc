"""A projection, not a measurement: the demo pair's measured acceptance (tau) on Qwen3-8B-shape step costs.

    python -m flashpd.bench.project_8b --speedup bench/results/2026-11-30_demo_pair_v6_b80a182/speedup_demo_pair_h200.json \
        --steps bench/results/2026-11-29_dflash_step_6463c8e/dflash_step_h200.json --out bench/results/project_8b_h200.json

The formula, per prompt: speedup ~= tau x native_step_ms / dflash_step_ms. A native request of N tokens takes
about N native steps; a DFlash request commits tau tokens a step, so it takes about N / tau DFlash steps. Its
assumptions, which the JSON states beside the figures:
- decode only: the prefill (TTFT) is left out; both methods pay the same one, so it would pull the ratio
  towards 1, the more the longer the prompt and the fewer the tokens;
- acceptance is borrowed: tau per prompt comes from the demo pair (a small target and drafter trained on
  held-out Python standard-library text), not from Qwen3-8B and its DFlash-b16 drafter on real prompts;
- every DFlash step costs the width-16 step and every native step the one-token step, both at batch 1 and at
  the step JSON's one context length (the costs of dummy weights: a step's cost does not depend on them);
- no host or scheduling cost beyond what the step JSON's timings hold.

Inputs: a speedup JSON of the demo pair (bench/speedup.py: `confirm` and `screen` sections, each with its
`width`, `new_tokens` and per-prompt `tau`), and a step-cost JSON at the 8B shape, read through `step_costs`:
bench/speed_8b.py's top-level `native_step_ms_b1` and `dflash_step_ms_b1`, or bench/dflash_step.py's kernels
(`target_step`, and `verify16` + `draft16`, timed apart: the fused step runs both passes in one graph). Beside
the projection: the seed's measured 2.154x and the published Qwen3-8B DFlash figures, quoted with their source,
and what the same step costs give at the published tau.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

FORMULA = "speedup ~= tau x native_step_ms / dflash_step_ms (per prompt; geomean over prompts)"
ASSUMPTIONS = [
    "decode only: prefill (TTFT) excluded; both methods pay the same prefill, which would pull the ratio towards 1",
    "acceptance borrowed from the demo pair (its measured tau per prompt), not measured on Qwen3-8B and its drafter",
    "every DFlash step costs the width-16 step and every native step the one-token step, at batch 1 and at the step "
    "JSON's context length",
    "no host or scheduling cost beyond what the step timings hold",
]

SEED = {
    "source": "the project seed results page (seed 000: the vLLM DFlash run)",
    "geomean_speedup": 2.154,
    "quote": "On four disjoint prompts, native Qwen3-8B took a median 804 to 845 milliseconds to generate 64 greedy "
             "tokens. DFlash completed the same requests in 318 to 432 milliseconds. Every prompt won, with paired "
             "speedups from 1.876\u00d7 to 2.526\u00d7. Across three timed repetitions per prompt, the "
             "geometric-mean speedup was 2.154\u00d7 and the paired median was 2.136\u00d7. DFlash produced exactly "
             "the same token IDs as the native vLLM baseline in all 12 comparisons.",
    "setup": "Qwen3-8B, DFlash-b16 (16-token blocks) against native vLLM, 64 greedy tokens, batch 1, end to end "
             "(prefill included)",
}

PUBLISHED = {
    "source": "the design card dflash.md, section \"Published figures (for the compass, not for tests)\"",
    "quote": "Reference implementation, B200, transformers backend, batch 1, temperature 0, Qwen3-8B-DFlash-b16 "
             "against plain decoding in the same code: speedup 5.2x / tau 6.55 on GSM8K, 6.17x / 7.87 on MATH500, "
             "5.2x / 6.55 on HumanEval, 2.79x / 4.25 on MT-Bench, 2.27x / 3.16 on Alpaca. EAGLE-3 in the same "
             "setup: about 2.2x (tau about 3).",
    "figures": [{"dataset": "GSM8K", "speedup": 5.2, "tau": 6.55}, {"dataset": "MATH500", "speedup": 6.17, "tau": 7.87},
                {"dataset": "HumanEval", "speedup": 5.2, "tau": 6.55},
                {"dataset": "MT-Bench", "speedup": 2.79, "tau": 4.25},
                {"dataset": "Alpaca", "speedup": 2.27, "tau": 3.16}],
}


def step_costs(d: dict) -> dict:
    """(native, DFlash width-16) step ms at batch 1 from either step JSON, with where they came from."""
    if "native_step_ms_b1" in d and "dflash_step_ms_b1" in d:
        return {"native_step_ms": float(d["native_step_ms_b1"]), "dflash_step_ms": float(d["dflash_step_ms_b1"]),
                "format": "speed_8b", "fields": ["native_step_ms_b1", "dflash_step_ms_b1"],
                "context": d.get("context"), "config": d.get("config"), "weights": d.get("weights")}
    k = d.get("kernels") or {}
    if all(name in k for name in ("target_step", "verify16", "draft16")):
        return {"native_step_ms": float(k["target_step"]["median_ms"]),
                "dflash_step_ms": float(k["verify16"]["median_ms"]) + float(k["draft16"]["median_ms"]),
                "format": "dflash_step",
                "fields": ["kernels.target_step.median_ms", "kernels.verify16.median_ms + kernels.draft16.median_ms"],
                "context": d.get("context"), "config": d.get("config"), "weights": d.get("weights")}
    raise ValueError("step JSON: neither native_step_ms_b1 / dflash_step_ms_b1 (bench/speed_8b.py) nor kernels "
                     "target_step / verify16 / draft16 (bench/dflash_step.py)")


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def sections(d: dict, width: int) -> list[dict]:
    """The speedup JSON's sections at this width: confirmations first (repeated timings), then the screen."""
    out = []
    for kind in ("confirm", "screen"):
        for s in d.get(kind) or []:
            if s.get("width") == width and s.get("prompts"):
                out.append({"section": kind, **s})
    return out


def project(speedup: dict, steps: dict, width: int = 16) -> dict:
    cost = step_costs(steps)
    ratio = cost["native_step_ms"] / cost["dflash_step_ms"]
    rows = []
    for s in sections(speedup, width):
        taus = [float(p["tau"]) for p in s["prompts"] if p.get("tau")]
        if not taus:
            continue
        proj = [t * ratio for t in taus]
        rows.append({"section": s["section"], "width": s["width"], "new_tokens": s.get("new_tokens"),
                     "reps": s.get("reps"), "prompts": len(taus),
                     "tau_per_prompt": taus, "tau_mean": statistics.fmean(taus),
                     "projected_speedup_per_prompt": proj, "projected_geomean_speedup": _geomean(proj),
                     "projected_median_speedup": statistics.median(proj),
                     "projected_min_speedup": min(proj), "projected_max_speedup": max(proj),
                     "demo_pair_measured_geomean_speedup": s.get("geomean_speedup")})
    if not rows:
        raise ValueError(f"speedup JSON: no section at width {width} with per-prompt tau")
    # the headline: a confirmation at 64 tokens (the seed's length) when there is one
    head = next((r for r in rows if r["section"] == "confirm" and r["new_tokens"] == 64),
                next((r for r in rows if r["section"] == "confirm"), rows[0]))
    published = [{**f, "speedup_per_tau": f["speedup"] / f["tau"], "projected_here_at_this_tau": f["tau"] * ratio}
                 for f in PUBLISHED["figures"]]
    return {
        "kind": "projection",
        "label": "PROJECTION, not a measurement: the demo pair's tau on 8B-shape step costs",
        "formula": FORMULA,
        "assumptions": ASSUMPTIONS,
        "step_costs": cost,
        "native_over_dflash_step": ratio,
        "tau_source": {"target": speedup.get("target"), "draft": speedup.get("draft"), "git": speedup.get("git"),
                       "dtype": speedup.get("dtype"), "batch": speedup.get("batch"), "width": width},
        "headline": {"section": head["section"], "new_tokens": head["new_tokens"], "tau_mean": head["tau_mean"],
                     "projected_geomean_speedup": head["projected_geomean_speedup"]},
        "projections": rows,
        "beside": {
            "seed": SEED,
            "published": {**PUBLISHED, "figures": published,
                          "derived_here": "speedup_per_tau: the published speedup over its tau (what the formula's "
                                          "native/DFlash step ratio would have to be); projected_here_at_this_tau: "
                                          "that tau on this JSON's step costs (a projection too)"},
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speedup", default="bench/results/2026-11-30_demo_pair_v6_b80a182/speedup_demo_pair_h200.json",
                    help="the demo pair's speedup JSON (bench/speedup.py); default: the shipped pair's (v6; "
                         "bench/results/2026-11-29_speedup_v1_54a9057/speedup_demo_pair_h200.json is v1's, with width 16 in its screen only)")
    ap.add_argument("--steps", default="bench/results/2026-11-29_dflash_step_6463c8e/dflash_step_h200.json",
                    help="8B-shape step costs: bench/speed_8b.py's JSON or bench/dflash_step.py's")
    ap.add_argument("--width", type=int, default=16, help="the DFlash block width the step costs are for")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    result = project(json.loads(Path(a.speedup).read_text()), json.loads(Path(a.steps).read_text()), a.width)
    result = {**result, "inputs": {"speedup": a.speedup, "steps": a.steps},
              "command": "python -m flashpd.bench.project_8b " + " ".join(argv if argv is not None else sys.argv[1:])}
    from flashpd.bench.common import write_json  # noqa: PLC0415  (imports torch)

    path = write_json(a.out, result)
    h = result["headline"]
    print(f"projection ({h['section']}, {h['new_tokens']} tokens): tau {h['tau_mean']:.2f} x "
          f"{result['native_over_dflash_step']:.3f} -> x{h['projected_geomean_speedup']:.2f} geomean "
          f"(seed measured x{SEED['geomean_speedup']}); wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

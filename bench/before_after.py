"""Compare two runs of the same measurements at two revisions: step times and the speedup protocol.

Each run folder holds what that revision's own bench scripts wrote (the commands go in the run's README):
`profile_demo.json` and `profile_8b.json` (bench/profile_step.py, demo pair and Qwen3-8B shape)
and `speedup.json` (bench/speedup.py). The output JSON gives every compared figure before and after, its
ratio (after / before), and whether it stays within the tolerance (a structural change must not move speed).

    python -m flashpd.bench.before_after --before DIR --after DIR --out FILE.json [--tolerance 0.03] \
        [--exclude-prompts 0 --exclude-reason "..."]

A speedup-protocol figure compares speed only where both revisions ran the same work: the same tokens. In bf16
a prompt at a near-tie can take another continuation when the compiled kernels change (a refactor of the step
changes inductor's fusions), and then its times are those of other work. `--exclude-prompts` names such
prompts (confirmation-set indices, with the evidence in `--exclude-reason`); the speedup figures are then also
given over the other prompts (suffix `_matched`), and `all_within_matched` judges the step figures with those.
The full-set figures and `all_within` stay in the output, unchanged.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from flashpd.bench.common import write_json


def _load(d: Path, name: str) -> dict:
    return json.loads((d / name).read_text())


def step_figures(run: Path) -> dict[str, float]:
    """Device-loop ms per step (native, DFlash at the profile's block width), context 256, batch 1."""
    out = {}
    for shape, name in (("demo", "profile_demo.json"), ("8b", "profile_8b.json")):
        row = next(r for r in _load(run, name)["rows"] if r["context"] == 256)
        for method in ("native", "dflash"):
            out[f"{shape}_{method}_step_ms"] = row[f"{method}_device_loop"]["wall_ms_per_step_median"]
    return out


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def speedup_figures(run: Path, exclude: frozenset[int] = frozenset(), suffix: str = "") -> dict[str, float]:
    """Per confirmation set (new-token count): the geomean speedup, and the geomean request time of each
    method (the whole `generate` call, the driver included), over the prompts not in `exclude`."""
    out = {}
    for c in _load(run, "speedup.json")["confirm"]:
        n = c["new_tokens"]
        prompts = [p for p in c["prompts"] if p["prompt"] not in exclude]
        out[f"speedup_geomean_{n}{suffix}"] = _geomean([p["speedup"] for p in prompts])
        for method in ("native", "dflash"):
            out[f"{method}_request_ms_geomean_{n}{suffix}"] = _geomean([p[f"{method}_median_ms"] for p in prompts])
    return out


def compare(before: Path, after: Path, tolerance: float, exclude: frozenset[int] = frozenset(),
            reason: str = "") -> dict:
    b = {**step_figures(before), **speedup_figures(before)}
    a = {**step_figures(after), **speedup_figures(after)}
    if exclude:
        b.update(speedup_figures(before, exclude, "_matched"))
        a.update(speedup_figures(after, exclude, "_matched"))
    rows = {}
    for k in b:
        if k in a:
            r = a[k] / b[k]
            rows[k] = {"before": b[k], "after": a[k], "after_over_before": r, "within": abs(r - 1) <= tolerance}
    revs = {name: _load(d, "speedup.json").get("git") for name, d in (("before", before), ("after", after))}
    res = {"bench": "before_after", "revisions": revs, "tolerance": tolerance, "figures": rows,
           "all_within": all(r["within"] for r in rows.values())}
    if exclude:
        res["excluded_prompts"] = sorted(exclude)
        res["exclude_reason"] = reason
        res["all_within_matched"] = all(r["within"] for k, r in rows.items()
                                        if k.endswith("_matched") or k.endswith("_step_ms"))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the earlier revision's run folder")
    ap.add_argument("--after", required=True, help="the later revision's run folder")
    ap.add_argument("--tolerance", type=float, default=0.03, help="largest |after / before - 1| called unchanged")
    ap.add_argument("--exclude-prompts", default="",
                    help="confirmation-set prompt indices whose tokens differ between the revisions")
    ap.add_argument("--exclude-reason", default="", help="the evidence that they differ (required with them)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    exclude = frozenset(int(x) for x in a.exclude_prompts.split(",") if x)
    if exclude and not a.exclude_reason:
        ap.error("--exclude-prompts needs --exclude-reason")
    res = compare(Path(a.before), Path(a.after), a.tolerance, exclude, a.exclude_reason)
    res["command"] = (f"python -m flashpd.bench.before_after --before {a.before} --after {a.after} "
                      f"--tolerance {a.tolerance}"
                      + (f" --exclude-prompts {a.exclude_prompts} --exclude-reason '{a.exclude_reason}'"
                         if exclude else "") + f" --out {a.out}")
    write_json(Path(a.out), res)
    for k, r in res["figures"].items():
        print(f"{k:32s} {r['before']:10.3f} {r['after']:10.3f}  x{r['after_over_before']:.3f}"
              f"{'' if r['within'] else '  OUTSIDE'}")
    print(f"all within {a.tolerance:.0%}: {res['all_within']}")
    if exclude:
        print(f"steps and the matched prompts within {a.tolerance:.0%}: {res['all_within_matched']}")


if __name__ == "__main__":
    main()

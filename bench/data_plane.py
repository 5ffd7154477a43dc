"""The data plane's figures in one JSON, each read from the run that measured it (issue 20's fields).

    python -m flashpd.bench.data_plane --handoff H.json --ttft T.json --bridge B.json --sweep S.json \\
        --out bench/results/data_plane_h200.json

  handoff_ms_2048            bench/handoff.py: median P->D import of a 2,048-token prompt between two
                             processes on one device (both halves; the once-per-exporter mapping apart)
  host_tier_hit_speedup      bench/ttft_hit.py: geometric mean of cold TTFT over a host-tier hit's TTFT
  grpc_gbps                  bench/bridge_throughput.py: the best config's lower of Put and Get GB/s
  disagg_over_colocated_ttft bench/job_sweep.py: disaggregated TTFT P50 over colocated at concurrency 1,
                             over all the level's prompts, the same in both modes (the worse of the methods)
  sweep_long_ttft_p50_ratio  the same sweep: long-prompt TTFT P50, disaggregated over colocated, worst level
A figure whose input is missing is null, never guessed. The inputs are kept beside the output.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flashpd.bench.common import write_json


def _load(path: str | None) -> dict | None:
    return json.loads(Path(path).read_text()) if path and Path(path).exists() else None


def handoff_ms(h: dict | None) -> float | None:
    return None if h is None else h["import_ms_median"]


def host_speedup(t: dict | None) -> float | None:
    if t is None:
        return None
    return (t.get("summary", {}).get("host") or {}).get("geomean")


def grpc_gbps(b: dict | None) -> float | None:
    if b is None:
        return None
    rows = [r for r in b.get("results", []) if r.get("transport", "inline") == "inline"]
    best = [min(r["put_gb_per_s"], r["get_gb_per_s"]) for r in rows if "put_gb_per_s" in r and "get_gb_per_s" in r]
    return max(best) if best else None


def _p50(row: dict, key: str) -> float | None:
    v = row.get(key) or {}
    return v.get("p50")


def sweep_ratios(s: dict | None) -> tuple[float | None, float | None, dict]:
    """(c=1 TTFT ratio over all prompts, worst long-prompt TTFT ratio, the per-level ratios: long prompts, and
    at c=1 all prompts) of disaggregated over colocated."""
    if s is None:
        return None, None, {}
    by = {(r["mode"], r["method"], r["concurrency"]): r for r in s["runs"]}
    c1, long_, levels = [], [], {}
    for (mode, method, c), row in by.items():
        if mode != "disaggregated" or ("colocated", method, c) not in by:
            continue
        ref = by[("colocated", method, c)]
        a, b = _p50(row, "ttft_ms"), _p50(ref, "ttft_ms")
        if c == 1 and a and b:
            c1.append(a / b)
            levels[f"{method}_c1_all_prompts"] = a / b
        la, lb = _p50(row, "ttft_long_ms"), _p50(ref, "ttft_long_ms")
        if la and lb:
            long_.append(la / lb)
            levels[f"{method}_c{c}_long"] = la / lb
    return (max(c1) if c1 else None), (max(long_) if long_ else None), levels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="issue 20's data-plane figures from their runs' JSON")
    for name in ("handoff", "ttft", "bridge", "sweep"):
        ap.add_argument(f"--{name}")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    h, t, b, s = (_load(p) for p in (a.handoff, a.ttft, a.bridge, a.sweep))
    c1, long_, levels = sweep_ratios(s)
    out = {"handoff_ms_2048": handoff_ms(h), "disagg_over_colocated_ttft": c1, "host_tier_hit_speedup": host_speedup(t),
           "grpc_gbps": grpc_gbps(b), "sweep_long_ttft_p50_ratio": long_, "sweep_ttft_ratios_by_level": levels,
           "aims": {"handoff_ms_2048": "<= 10", "disagg_over_colocated_ttft": "<= 1.2", "host_tier_hit_speedup": ">= 3",
                    "grpc_gbps": ">= 2", "sweep_long_ttft_p50_ratio": "<= 1.3"},
           "inputs": {"handoff": a.handoff, "ttft": a.ttft, "bridge": a.bridge, "sweep": a.sweep},
           "commands": {k: (v or {}).get("command") for k, v in (("handoff", h), ("ttft", t), ("bridge", b), ("sweep", s))}}
    write_json(a.out, out)
    print(json.dumps({k: out[k] for k in list(out)[:5]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

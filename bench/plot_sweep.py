"""Charts of a load sweep's JSON (bench/job_sweep.py): TTFT P50, latency P50, output tokens/s and tau
against concurrency, one line per (mode, method); the title says whether the levels shared one prompt pool.

    python -m flashpd.bench.plot_sweep bench/results/2026-11-29_h200_battery_54ed0c7/serve_sweep_demo_2gpu_h200.json [...]

Writes <json stem>.png beside each JSON and prints its name.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(path.read_text())
    lines: dict[tuple[str, str], list[dict]] = {}
    for r in d["runs"]:
        lines.setdefault((r["mode"], r["method"]), []).append(r)
    panels = [("TTFT P50 (ms)", lambda r: r["ttft_ms"]["p50"]), ("latency P50 (ms)", lambda r: r["latency_ms"]["p50"]),
              ("output tokens/s", lambda r: r["output_tokens_per_s"]), ("tau (DFlash)", lambda r: r.get("tau"))]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    for ax, (label, get) in zip(axes, panels):
        for (mode, method), rows in sorted(lines.items()):
            rows = sorted(rows, key=lambda r: r["concurrency"])
            if all(get(r) is None for r in rows):
                continue
            ax.plot([r["concurrency"] for r in rows], [get(r) for r in rows], "o-" if method == "dflash" else "s--",
                    label=f"{mode} / {method}")
        ax.set_xscale("log", base=2), ax.set_xlabel("concurrent clients"), ax.set_ylabel(label), ax.grid(alpha=.3)
        if label.startswith("tau"):
            ax.set_ylim(bottom=1)  # tau is at least 1: a zoomed axis would make noise look like a trend
    axes[0].legend(fontsize=7)
    ex = d.get("exact", {})
    pool = (d.get("settings") or {}).get("prompt_pool")
    prompts = (f"every level from one pool of {pool['size']} prompts (seed {pool['seed']})" if pool
               else "a fresh prompt set per level")
    agree = f"modes agree on {ex.get('identical', '?')}/{ex.get('compared', '?')} outputs"
    if d.get("exact_methods"):
        em = d["exact_methods"].values()
        agree += (f"; native = DFlash on {sum(e['identical'] for e in em)}/{sum(e['compared'] for e in em)}"
                  f"{' (bf16)' if (d.get('settings') or {}).get('dtype') == 'bfloat16' else ''}")
    fig.suptitle(f"{path.stem} (git {d.get('git', '?')}; {prompts}; {agree})", fontsize=9)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(plot(Path(arg)))

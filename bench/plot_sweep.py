"""Charts of a load sweep's JSON (bench/job_sweep.py): TTFT P50, latency P50 and output tokens/s
against concurrency, one line per (mode, method).

    python -m flashpd.bench.plot_sweep bench/results/serve_sweep_demo_2gpu_h200.json [...]

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
              ("output tokens/s", lambda r: r["output_tokens_per_s"])]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (label, get) in zip(axes, panels):
        for (mode, method), rows in sorted(lines.items()):
            rows = sorted(rows, key=lambda r: r["concurrency"])
            ax.plot([r["concurrency"] for r in rows], [get(r) for r in rows], "o-" if method == "dflash" else "s--",
                    label=f"{mode} / {method}")
        ax.set_xscale("log", base=2), ax.set_xlabel("concurrent clients"), ax.set_ylabel(label), ax.grid(alpha=.3)
    axes[0].legend(fontsize=7)
    ex = d.get("exact", {})
    fig.suptitle(f"{path.stem} (git {d.get('git', '?')}; modes agree on {ex.get('identical', '?')}/{ex.get('compared', '?')} outputs)",
                 fontsize=9)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(plot(Path(arg)))

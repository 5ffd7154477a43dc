"""Charts of a mixed-load benchmark's JSON (bench/pd_benefit.py), drawn from the JSON alone:

    python -m flashpd.bench.plot_pd_benefit bench/results/pd_benefit_2gpu_h200.json [...]

Writes beside each JSON, and prints, <stem>_ttft_p99.png and <stem>_itl_p99.png (P99 against the offered
rate, one line per configuration and method, the SLO drawn for TTFT), <stem>_slo.png (SLO attainment
against rate, with the attainment goodput needs) and <stem>_goodput.png (goodput bars per configuration,
one bar per method). matplotlib is the optional `bench` extra (pip install 'flashpd[bench]').
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        raise SystemExit("plotting needs matplotlib, the optional `bench` extra: pip install 'flashpd[bench]' "
                         "(the JSON is complete without the charts)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _lines(d: dict) -> dict[tuple[str, str], list[dict]]:
    """(config, method) -> its rows in rate order, configurations in the order they were asked for."""
    order = {c: i for i, c in enumerate(d["settings"]["configs"])}
    out: dict[tuple[str, str], list[dict]] = {}
    for r in d["runs"]:
        out.setdefault((r["config"], r["method"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["rate"])
            for k, v in sorted(out.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1]))}


def _title(path: Path, d: dict) -> str:
    s, g = d["settings"], d.get("gpus", {})
    where = f"{g.get('count', '?')} GPU(s)" if g.get("device") == "cuda" else g.get("device", "?")
    return (f"{path.stem} (git {str(d.get('git', '?'))[:12]}; {where}; SLO TTFT {s['ttft_slo_ms']:g} ms, "
            f"TPOT {s['tpot_slo_ms']:g} ms)")


def plot(path: str | Path) -> list[Path]:
    """Draw the four charts of one JSON; -> their paths."""
    plt = _pyplot()
    path = Path(path)
    d = json.loads(path.read_text())
    lines = _lines(d)
    s = d["settings"]
    rates = sorted({r["rate"] for r in d["runs"]})
    colour = {c: f"C{i}" for i, c in enumerate(dict.fromkeys(c for c, _ in lines))}
    out = []
    for key, label, slo in (("ttft_ms", "TTFT P99 (ms)", s["ttft_slo_ms"]), ("itl_ms", "inter-token latency P99 (ms)",
                                                                              None),
                            ("slo", "SLO attainment", s["slo_attainment"])):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for (config, method), rows in lines.items():  # a colour per configuration, a line style per method
            ys = [r["slo_attainment"] if key == "slo" else r[key]["p99"] for r in rows]
            ax.plot([r["rate"] for r in rows], ys, "o-" if method == "dflash" else "s--", color=colour[config],
                    label=f"{config} / {method}")
        if slo is not None:
            ax.axhline(slo, color="gray", lw=0.8, ls=":", label="SLO" if key != "slo" else "goodput threshold")
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        if key != "slo":
            ax.set_yscale("log")
        ax.set_xlabel("offered rate (requests/s, Poisson)"), ax.set_ylabel(label), ax.grid(alpha=.3)
        ax.legend(fontsize=7)
        ax.set_title(_title(path, d), fontsize=7)
        fig.tight_layout()
        p = path.with_name(f"{path.stem}_{'slo' if key == 'slo' else key.split('_')[0] + '_p99'}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        out.append(p)
    good = d["goodput"]
    configs = [c for c in s["configs"] if c in good] + [c for c in good if c not in s["configs"]]
    methods = sorted({m for c in configs for m in good[c]})
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    w = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * w for i in range(len(configs))]
        ys = [good[c].get(m, 0) for c in configs]
        bars = ax.bar(xs, ys, w, label=m)
        ax.bar_label(bars, fmt="%g", fontsize=7)
    ax.set_xticks(range(len(configs)), configs)
    ax.set_ylabel(f"goodput (requests/s, >= {s['slo_attainment']:.0%} within both SLOs)")
    ratio = d.get("p99_itl_disagg_over_replicas")
    ax.set_title(_title(path, d) + f"\nP99 ITL 1P1D / replicas ({d.get('p99_itl_disagg_over_replicas_method')}): "
                 + ("-" if ratio is None else f"{ratio:.2f}"), fontsize=7)
    ax.legend(fontsize=7), ax.grid(alpha=.3, axis="y")
    fig.tight_layout()
    p = path.with_name(f"{path.stem}_goodput.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    out.append(p)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        for p in plot(Path(arg)):
            print(p)

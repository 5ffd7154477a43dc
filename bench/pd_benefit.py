"""Mixed-load benchmark (issue 24): 1P1D against two colocated replicas on the same GPUs, open-loop Poisson load.

    python -m flashpd.bench.pd_benefit --out bench/results/pd_benefit_2gpu_h200.json
        [--configs replicas,1p1d-device,colocated] [--methods native,dflash] [--rates 1,2,4,8,16]
        [--requests 64] [--ttft-slo-ms 2000] [--tpot-slo-ms 30] [--gpus N] [--resume] [--plot]

Configurations (each started in turn as `flashpd serve` through job_sweep.ServeProcess, all on the same GPUs):
  replicas     mode local, prefill_workers 0, decode_workers 2: two colocated replicas behind the router, the
               fair baseline for 1P1D (the same two GPUs, each worker prefills and decodes its own requests)
  1p1d-device  mode local, 1 prefill + 1 decode worker, kv_transport device (same-host device-to-device copy)
  1p1d-bridge  the same with kv_transport bridge (published chunks through the KV bridge)
  colocated    mode colocated: one process on one GPU, for reference
Every configuration serves both methods from one start (native and DFlash are per request).

Load: per rate, `--requests` requests arrive open loop as a seeded Poisson process (exponential gaps, mean
1/rate; the same arrival times and prompts for every configuration and method). Each request gets its own
client thread, started at its arrival time whatever the earlier requests are doing; the threads share a few
gRPC channels. The prompts mix short ones (--short-tokens range) with a --long-fraction of long ones
(--long-tokens range, capped to fit the target's positions with the output), each with a --max-tokens
decode tail (ignore_eos, so every request decodes exactly that many tokens). Prompts come from
job_sweep.make_prompts (held-out text when the target has a tokenizer, else random ids), a disjoint set
per rate so no configuration ever gets a prefix-cache hit.

Measured per request, at the client, from its scheduled arrival time (so a late client thread counts too):
  TTFT   time to the first chunk carrying tokens
  TPOT   (latency - TTFT) / (output_tokens - 1), latency = the end of the stream
  ITL    gaps between consecutive streamed chunks that carry tokens. Rule: a chunk carrying k tokens that
         arrives g ms after the previous one gives k samples of g / k, so a DFlash burst counts per token (a
         16-token burst after 16 ms is sixteen 1 ms gaps, not one 16 ms gap and fifteen zeros). The tokens
         of the first chunk give none (they are TTFT). Per rate all requests' samples are pooled.
Per (configuration, method, rate): TTFT, TPOT and ITL P50/P90/P99, TTFT of short and long prompts apart,
throughput, errors, and SLO attainment: the share of the requests sent (an error counts as a miss) with
TTFT <= --ttft-slo-ms and TPOT <= --tpot-slo-ms. Beside them, worker_counters: what the workers' own
Prometheus counters (preemptions, device-path imports and fallbacks, prefill holds) rose by during the rate,
summed by role, so a row's cause can be read off it (none for a colocated service).

Summary fields of the JSON:
  goodput[config][method]          the highest rate measured at which >= --slo-attainment (90%) of requests
                                   met both SLOs; 0 when none did
  p99_itl_disagg_over_replicas     1P1D's P99 ITL over the replicas', at the highest rate where both met the
                                   SLO (attainment), for DFlash (native when DFlash was not run) and the
                                   1P1D configuration 1p1d-device (1p1d-bridge when that is the only one)
  p99_itl_disagg_over_replicas_by_method   the same per method; ..._by_config: per 1P1D config and method
  aim                              issue 24's aim for that number: <= 0.5 with 1P1D goodput >= replicas'
  gpus                             device, how many GPUs, and each configuration's workers' GPU indices
Rates above one where attainment fell below --stop-below are skipped (listed under "skipped").

The JSON is rewritten after every rate (no machine block then: nothing here initialises CUDA while workers
run) and finally through bench.common.write_json. A run cut short by --time-budget-s (or killed) is resumed
by the same command with --resume: the measured (config, method, rate) rows are kept, the rest is run
(--configs and --methods may change between the commands; the workload, WORKLOAD_KEYS, may not). Graph
captures and compiles of shapes first met inside a timed rate would show as ITL spikes: the warm-up pass
(--warmup) at the highest rate is there to meet most of them first.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from flashpd.bench.load_gen import centiles

log = logging.getLogger("flashpd.pd_benefit")

KIND = "pd_benefit"
# name -> ServeConfig keys; mode "local" is the local launcher (plain processes)
CONFIGS: dict[str, dict] = {
    "replicas": dict(mode="local", prefill_workers=0, decode_workers=2),
    "1p1d-device": dict(mode="local", prefill_workers=1, decode_workers=1, kv_transport="device"),
    "1p1d-bridge": dict(mode="local", prefill_workers=1, decode_workers=1, kv_transport="bridge"),
    "colocated": dict(mode="colocated"),
}
DISAGG = ("1p1d-device", "1p1d-bridge")  # in order of preference for the top-level ratio
BASELINE = "replicas"
AIM_RATIO = 0.5
DFLASH_BLOCK = 16  # room a DFlash verify may need past the last output token


# ---- statistics (pure functions; tests/test_pd_benefit.py checks them on hand-made data) ---------------------

def pcts(xs: list[float]) -> dict:
    """P50/P90/P99 (inclusive linear interpolation, as load_gen.percentiles), mean, max and count."""
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None, "n": 0}
    s = sorted(xs)
    q = centiles(s)
    return {"p50": q[49], "p90": q[89], "p99": q[98], "mean": statistics.fmean(s), "max": s[-1], "n": len(s)}


def itl_samples(chunks: list[tuple[float, int]]) -> list[float]:
    """Inter-token latencies of one request from its token-carrying chunks, (arrival ms, tokens) in order:
    a chunk of k tokens g ms after the previous chunk gives k samples of g / k; the first chunk gives none."""
    out: list[float] = []
    for (t0, _), (t1, k) in zip(chunks, chunks[1:]):
        if k > 0:
            out.extend([(t1 - t0) / k] * k)
    return out


def tpot_ms(ttft: float | None, latency: float | None, tokens: int) -> float | None:
    """(latency - TTFT) / (tokens - 1); None with fewer than two tokens (no decode step to time)."""
    if ttft is None or latency is None or tokens < 2:
        return None
    return (latency - ttft) / (tokens - 1)


def meets_slo(r: "Req", ttft_slo_ms: float, tpot_slo_ms: float) -> bool:
    """Served without error, TTFT within its SLO and TPOT within its SLO (a one-token request has no TPOT)."""
    if r.error is not None or r.ttft_ms is None or r.ttft_ms > ttft_slo_ms:
        return False
    t = r.tpot_ms
    return t is None or t <= tpot_slo_ms


def goodput(rows: list[dict], attainment: float = 0.9) -> float:
    """The highest rate among `rows` (one configuration and method) whose SLO attainment is >= `attainment`;
    0 when none is."""
    ok = [r["rate"] for r in rows if r["slo_attainment"] is not None and r["slo_attainment"] >= attainment]
    return max(ok) if ok else 0


def itl_ratio(num_rows: list[dict], den_rows: list[dict], attainment: float = 0.9) -> dict:
    """P99 ITL of `num_rows` over `den_rows` (one method each) at the highest rate both measured and both met
    the SLO attainment at; ratio None (with the reason) when there is no such rate."""
    def good(rows: list[dict]) -> dict:
        return {r["rate"]: r for r in rows if r["slo_attainment"] is not None and r["slo_attainment"] >= attainment}

    a, b = good(num_rows), good(den_rows)
    both = sorted(set(a) & set(b))
    if not both:
        return {"ratio": None, "rate": None, "why": "no rate where both met the SLO"}
    rate = both[-1]
    x, y = a[rate]["itl_ms"]["p99"], b[rate]["itl_ms"]["p99"]
    if x is None or not y:
        return {"ratio": None, "rate": rate, "why": "no ITL samples at that rate"}
    return {"ratio": x / y, "rate": rate, "num_p99_itl_ms": x, "den_p99_itl_ms": y}


def summarize_rate(reqs: list["Req"], wall_s: float, ttft_slo_ms: float, tpot_slo_ms: float) -> dict:
    """One (configuration, method, rate) row's figures from its requests."""
    ok = [r for r in reqs if r.error is None]
    steps = [a for r in ok for a in r.acceptance_lengths]
    out_tokens = sum(r.output_tokens for r in ok)
    itl = [x for r in ok for x in itl_samples(r.chunks)]
    met = sum(meets_slo(r, ttft_slo_ms, tpot_slo_ms) for r in reqs)
    return {
        "requests": len(reqs), "errors": len(reqs) - len(ok), "first_errors": [r.error for r in reqs if r.error][:3],
        "ttft_ms": pcts([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "ttft_short_ms": pcts([r.ttft_ms for r in ok if r.ttft_ms is not None and not r.long]),
        "ttft_long_ms": pcts([r.ttft_ms for r in ok if r.ttft_ms is not None and r.long]),
        "service_ttft_ms": pcts([r.service_ttft_ms for r in ok if r.service_ttft_ms]),
        "tpot_ms": pcts([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "itl_ms": pcts(itl),
        "latency_ms": pcts([r.latency_ms for r in ok if r.latency_ms is not None]),
        "slo_met": met, "slo_attainment": met / len(reqs) if reqs else None,
        "output_tokens": out_tokens, "chunks": sum(len(r.chunks) for r in ok),
        "multi_token_chunks": sum(1 for r in ok for _, k in r.chunks if k > 1),
        "wall_s": wall_s, "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
        "max_dispatch_lag_ms": max((r.dispatch_lag_ms for r in reqs), default=None),
        "tau": sum(steps) / len(steps) if steps else None,
    }


# ---- the workload ---------------------------------------------------------------------------------------------

def _range(s: str) -> tuple[int, int]:
    """"LO,HI" (or one number) -> (lo, hi)."""
    xs = [int(x) for x in str(s).split(",") if x.strip()]
    if not 1 <= len(xs) <= 2 or min(xs) < 1 or xs[0] > xs[-1]:
        raise ValueError(f"expected N or LO,HI with 1 <= LO <= HI, got {s!r}")
    return xs[0], xs[-1]


def _rates(s: str) -> list[float]:
    rs = sorted({float(x) for x in s.split(",") if x.strip()})
    if not rs or rs[0] <= 0:
        raise ValueError(f"--rates: positive requests/s, got {s!r}")
    return [int(r) if r == int(r) else r for r in rs]


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


@dataclass(frozen=True)
class Spec:
    """One request of a set: prompt length, whether it is a long one, its max_tokens, its arrival (s)."""
    prompt_tokens: int
    long: bool
    max_tokens: int
    arrival_s: float


def request_specs(n: int, rate: float, seed: int, long_fraction: float, short: tuple[int, int],
                  long: tuple[int, int], max_tokens: tuple[int, int]) -> list[Spec]:
    """n requests at `rate`: round(n * long_fraction) long ones at seeded positions, uniform lengths in their
    ranges, Poisson arrivals (the first at 0). Seeded by (seed, rate): the same for every configuration."""
    rng = random.Random(f"pd_benefit/{seed}/{rate}")
    n_long = round(n * long_fraction)
    longs = set(rng.sample(range(n), n_long))
    t, out = 0.0, []
    for i in range(n):
        is_long = i in longs
        lo, hi = long if is_long else short
        out.append(Spec(rng.randint(lo, hi), is_long, rng.randint(*max_tokens), t))
        t += rng.expovariate(rate)
    return out


def max_positions(target: str) -> int:
    return int(json.loads((Path(target) / "config.json").read_text())["max_position_embeddings"])


# ---- the open-loop driver -------------------------------------------------------------------------------------

@dataclass
class Req:
    """One request's record: chunks are (ms after its scheduled arrival, tokens) of each token-carrying chunk."""
    index: int
    prompt_tokens: int
    long: bool
    max_tokens: int
    arrival_s: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    ttft_ms: float | None = None
    latency_ms: float | None = None
    service_ttft_ms: float | None = None
    acceptance_lengths: list[int] = field(default_factory=list)
    dispatch_lag_ms: float = 0.0
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(k for _, k in self.chunks)

    @property
    def tpot_ms(self) -> float | None:
        return tpot_ms(self.ttft_ms, self.latency_ms, self.output_tokens)

    def record(self) -> dict:
        """The per-request record --per-request keeps (chunk times included, so ITL can be recomputed)."""
        return {"index": self.index, "prompt_tokens": self.prompt_tokens, "long": self.long,
                "max_tokens": self.max_tokens, "arrival_s": self.arrival_s, "ttft_ms": self.ttft_ms,
                "tpot_ms": self.tpot_ms, "latency_ms": self.latency_ms, "output_tokens": self.output_tokens,
                "chunks_ms": [t for t, _ in self.chunks], "chunk_tokens": [k for _, k in self.chunks],
                "dispatch_lag_ms": self.dispatch_lag_ms, "error": self.error}


def run_open_loop(address: str, prompts: list[list[int]], specs: list[Spec], method: str, timeout_s: float,
                  channels: int = 8) -> tuple[list[Req], float]:
    """Send request i at specs[i].arrival_s (s after the start) on its own thread, whatever the others are
    doing (open loop); returns the records in order and the wall time from the start to the last stream's
    end. Every wait is bounded: a request not finished by its arrival + timeout_s (+ slack) is an error."""
    from flashpd.cluster.generation_client import GenerationClient, GenerationError  # noqa: PLC0415

    reqs = [Req(i, s.prompt_tokens, s.long, s.max_tokens, s.arrival_s) for i, s in enumerate(specs)]
    clients = [GenerationClient(address, timeout_s=timeout_s) for _ in range(max(1, min(channels, len(specs))))]
    for c in clients:  # connect every channel before the clock starts
        c.health(timeout_s=30.0)
    done_at = [0.0] * len(reqs)

    def one(r: Req, c: GenerationClient, t_arr: float) -> None:
        r.dispatch_lag_ms = (time.perf_counter() - t_arr) * 1e3
        try:
            for ch in c.generate(prompts[r.index], max_tokens=r.max_tokens, method=method, ignore_eos=True):
                t = (time.perf_counter() - t_arr) * 1e3
                if ch.token_ids:
                    r.chunks.append((t, len(ch.token_ids)))
                    if r.ttft_ms is None:
                        r.ttft_ms = t
                if ch.finished and ch.stats:
                    r.acceptance_lengths = list(ch.stats["acceptance_lengths"])
                    r.service_ttft_ms = ch.stats.get("ttft_ms")
            r.latency_ms = (time.perf_counter() - t_arr) * 1e3
        except GenerationError as e:
            r.error = str(e)
        except Exception as e:  # noqa: BLE001  any client-side failure is this request's error, not the run's
            r.error = f"{type(e).__name__}: {e}"
        done_at[r.index] = time.perf_counter()

    threads = []
    t0 = time.perf_counter() + 0.05
    try:
        for r in reqs:
            t_arr = t0 + r.arrival_s
            delay = t_arr - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=one, args=(r, clients[r.index % len(clients)], t_arr), daemon=True,
                                  name=f"pd-req-{r.index}")
            th.start()
            threads.append(th)
        deadline = t0 + (specs[-1].arrival_s if specs else 0.0) + timeout_s + 30.0
        for th in threads:
            th.join(max(0.0, deadline - time.perf_counter()))
    finally:
        for c in clients:
            c.close()
    for r in reqs:
        if r.latency_ms is None and r.error is None:
            r.error = "not finished when the run's bound passed"
    wall = max([d for d in done_at if d > 0], default=t0) - t0
    return reqs, wall


# ---- the workers' own counters (why a row looks as it does: preemptions, device-path fallbacks, holds) -------

COUNTERS = ("flashpd_preemptions", "flashpd_handoff_imports", "flashpd_handoff_fallbacks",
            "flashpd_recompute_fallbacks", "flashpd_prefill_holds")


def worker_metrics(log_text: str) -> dict[str, str]:
    """{"decode0": HOST:PORT, ...}: each worker's Prometheus endpoint, from the lines the service logs at
    start ("decode worker 0 at ADDR (metrics HOST:PORT)"); none for a colocated service."""
    return {f"{m.group(1)}{m.group(2)}": m.group(3)
            for m in re.finditer(r"(\w+) worker (\d+) at \S+ \(metrics (\S+)\)", log_text)}


def scrape_counters(endpoints: dict[str, str]) -> dict[str, dict[str, float]]:
    """COUNTERS summed over each role's workers ({"decode": {name: value}}); a worker that does not answer is
    left out (this is context for a row, never a reason to fail it)."""
    import urllib.request  # noqa: PLC0415

    out: dict[str, dict[str, float]] = {}
    for worker, addr in endpoints.items():
        role = worker.rstrip("0123456789")
        try:
            text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
        except OSError as e:
            log.debug("metrics of %s at %s: %s", worker, addr, e)
            continue
        for ln in text.splitlines():
            if ln.startswith("#") or not ln.strip():
                continue
            name = ln.split("{")[0].split()[0].removesuffix("_total")
            if name in COUNTERS:
                got = out.setdefault(role, {})
                got[name] = got.get(name, 0.0) + float(ln.rsplit(None, 1)[-1])
    return out


def counter_delta(after: dict, before: dict) -> dict:
    return {role: {k: v - before.get(role, {}).get(k, 0.0) for k, v in vals.items()} for role, vals in after.items()}


# ---- configurations, placement, the sweep ---------------------------------------------------------------------

def serve_config(a: argparse.Namespace, name: str):
    """The ServeConfig of configuration `name`: --config's JSON, then the flags, then the configuration's keys."""
    from flashpd.cluster.config import ServeConfig  # noqa: PLC0415

    base = json.loads(Path(a.config).read_text()) if a.config else {}
    base.update(target=a.target, draft=a.draft)
    for k in ("device", "dtype", "kv_cache_tokens", "torch_threads"):
        if getattr(a, k) is not None:
            base[k] = getattr(a, k)
    base.update(chunk_tokens=a.chunk_tokens, max_running=a.max_running, port=0, metrics_port=None, http_port=None)
    base.update(CONFIGS[name])
    from flashpd.bench.job_sweep import MODE_ONLY  # noqa: PLC0415

    for k, only in MODE_ONLY.items():  # keys one mode alone takes (refused in the others): a base for every config
        if k in base and base.get("mode", "colocated") != only:
            base.pop(k)
    return ServeConfig.from_dict(base, f"pd_benefit {name}")


def restrict_gpus(n: int) -> None:
    """--gpus N: this process and every worker it starts see only the first N visible GPUs (GPU 0 for N = 1).
    Before anything initialises CUDA."""
    if n <= 0:
        return
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in vis.split(",") if x.strip()] if vis else [str(i) for i in range(n)]
    if len(ids) < n:
        raise SystemExit(f"--gpus {n}: only {len(ids)} visible ({vis!r})")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:n])


def gpu_info(a: argparse.Namespace, names: list[str]) -> dict:
    """Device, GPU count and each configuration's workers' GPU (index among the visible ones), as the local
    launcher places them (cluster/placement.local_gpu). Counts devices without creating a CUDA context."""
    import torch  # noqa: PLC0415

    from flashpd.cluster.placement import local_gpu  # noqa: PLC0415

    n = torch.cuda.device_count() if (a.device or "cuda") != "cpu" else 0
    device = a.device or ("cuda" if n else "cpu")
    placement = {}
    for name in names:
        cfg = serve_config(a, name)
        if cfg.mode == "colocated":
            placement[name] = {"server": 0 if n else "cpu"}
            continue
        where = {}
        for role, k in (("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers)):
            for i in range(k):
                g = local_gpu(role, i, cfg, n)
                where[f"{role}{i}"] = "cpu" if g is None else g
        placement[name] = where
    note = ("CPU: no GPU" if n == 0 else
            "one GPU: every configuration's workers share GPU 0" if n == 1 else
            f"{n} GPUs: workers placed by cluster/placement.local_gpu (prefill from the first, decode from the last)")
    return {"device": device, "count": n, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "one_gpu": n == 1, "note": note, "placement": placement}


# what a --resume must share with the run it continues (the prompt sets are cut from one stream in the order
# warm-up, then the rates: the same rates and warm-up give every rate the same prompts in every command)
WORKLOAD_KEYS = ("target", "draft", "rates", "requests", "long_fraction", "short_tokens", "long_tokens", "max_tokens",
                 "ttft_slo_ms", "tpot_slo_ms", "slo_attainment", "seed", "device", "dtype", "kv_cache_tokens",
                 "chunk_tokens", "max_running", "gpus", "warmup")


def settings_of(a: argparse.Namespace, long_range: tuple[int, int], prompt_source: str) -> dict:
    return {"target": a.target, "draft": a.draft, "configs": _names(a.configs), "methods": _names(a.methods),
            "rates": _rates(a.rates), "requests": a.requests, "long_fraction": a.long_fraction,
            "short_tokens": list(_range(a.short_tokens)), "long_tokens": list(_range(a.long_tokens)),
            "long_tokens_used": list(long_range), "max_tokens": list(_range(a.max_tokens)),
            "ttft_slo_ms": a.ttft_slo_ms, "tpot_slo_ms": a.tpot_slo_ms, "slo_attainment": a.slo_attainment,
            "stop_below": a.stop_below, "warmup": a.warmup, "seed": a.seed, "device": a.device, "dtype": a.dtype,
            "kv_cache_tokens": a.kv_cache_tokens, "chunk_tokens": a.chunk_tokens, "max_running": a.max_running,
            "torch_threads": a.torch_threads, "gpus": a.gpus, "channels": a.channels,
            "request_timeout_s": a.request_timeout_s, "prompt_source": prompt_source, "launcher": "local",
            "config_keys": {n: CONFIGS[n] for n in _names(a.configs)}, "itl_rule": (
                "gaps between consecutive token-carrying chunks; a chunk of k tokens arriving g ms after the "
                "previous gives k samples of g/k; the first chunk's tokens give none"),
            "tpot_rule": "(latency - TTFT) / (output_tokens - 1), latency = end of the stream, both from arrival"}


def summary(runs: list[dict], methods: list[str], attainment: float) -> dict:
    """goodput, the P99 ITL ratios and the aim, from the rows measured so far."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        by.setdefault((r["config"], r["method"]), []).append(r)
    good: dict[str, dict[str, float]] = {}
    for (c, m), rows in sorted(by.items()):
        good.setdefault(c, {})[m] = goodput(rows, attainment)
    by_config: dict[str, dict] = {}
    for d in DISAGG:
        for m in methods:
            if (d, m) in by and (BASELINE, m) in by:
                by_config.setdefault(d, {})[m] = itl_ratio(by[(d, m)], by[(BASELINE, m)], attainment)
    primary = next((d for d in DISAGG if d in by_config), None)
    by_method = {m: {**v, "disagg_config": primary} for m, v in by_config.get(primary, {}).items()}
    top_m = "dflash" if "dflash" in by_method else next(iter(by_method), None)
    top = by_method[top_m]["ratio"] if top_m else None
    aim = {"p99_itl_ratio_at_most": AIM_RATIO, "goodput_no_lower": None, "met": None}
    if top_m and primary:
        g_d, g_b = good.get(primary, {}).get(top_m), good.get(BASELINE, {}).get(top_m)
        aim["goodput_no_lower"] = g_d >= g_b if g_d is not None and g_b is not None else None
        aim["met"] = None if top is None else bool(top <= AIM_RATIO and aim["goodput_no_lower"])
    return {"goodput": good, "p99_itl_disagg_over_replicas": top,
            "p99_itl_disagg_over_replicas_method": top_m, "p99_itl_disagg_over_replicas_config": primary,
            "p99_itl_disagg_over_replicas_by_method": by_method, "p99_itl_disagg_over_replicas_by_config": by_config,
            "aim": aim}


def _load_previous(a: argparse.Namespace, settings: dict) -> tuple[list[dict], list[dict], list[str]]:
    """--resume: the rows, skips and commands of an earlier run of the same workload in --out."""
    p = Path(a.out)
    if not (a.resume and p.exists()):
        return [], [], []
    d = json.loads(p.read_text())
    if d.get("kind") != KIND:
        raise SystemExit(f"--resume: {p} is not a {KIND} result")
    old = {k: d.get("settings", {}).get(k) for k in WORKLOAD_KEYS}
    new = json.loads(json.dumps({k: settings[k] for k in WORKLOAD_KEYS}))
    from flashpd.bench.common import portable  # noqa: PLC0415

    if portable(old) != portable(new):
        diff = {k: (old[k], new[k]) for k in WORKLOAD_KEYS if portable(old[k]) != portable(new[k])}
        raise SystemExit(f"--resume: {p} holds another workload (differs in {diff}); give another --out")
    return d.get("runs", []), d.get("skipped", []), d.get("commands", [])


def sweep(a: argparse.Namespace, argv: list[str]) -> tuple[dict, bool]:
    """Run every (configuration, method, rate) not yet in --out; -> (the result, whether every one is done)."""
    from flashpd.bench.common import git_revision, portable  # noqa: PLC0415
    from flashpd.bench.job_sweep import ServeProcess, make_prompts  # noqa: PLC0415

    t_start = time.monotonic()
    configs, methods, rates = _names(a.configs), _names(a.methods), _rates(a.rates)
    short, mt = _range(a.short_tokens), _range(a.max_tokens)
    room = max_positions(a.target) - mt[1] - DFLASH_BLOCK
    lo, hi = _range(a.long_tokens)
    long_range = (min(lo, room), min(hi, room))
    if short[1] > room:
        raise SystemExit(f"--short-tokens {a.short_tokens}: a prompt plus --max-tokens {mt[1]} must fit the "
                         f"target's {max_positions(a.target)} positions")
    if long_range != (lo, hi):
        log.warning("long prompts capped to %s tokens: the target has %d positions and the output needs %d",
                    long_range, max_positions(a.target), mt[1] + DFLASH_BLOCK)
    # the sets: one per rate and a warm-up set, disjoint, shared by every configuration and method. The
    # warm-up: the shortest and the longest prompt at once, then the mix arriving at the highest rate, so the
    # batch and context shapes the rates meet are mostly captured / compiled before any is timed
    specs = {r: request_specs(a.requests, r, a.seed, a.long_fraction, short, long_range, mt) for r in rates}
    warm = [Spec(short[0], False, mt[1], 0.0), Spec(long_range[1], True, mt[1], 0.0)][:a.warmup]
    warm += request_specs(max(0, a.warmup - len(warm)), rates[-1], a.seed + 1, a.long_fraction, short, long_range,
                          mt)
    keys = ["warmup", *rates]
    sets = {"warmup": warm, **specs}
    allp = make_prompts(a.target, [s.prompt_tokens for k in keys for s in sets[k]], a.seed)
    has_tok = (Path(a.target) / "tokenizer.json").exists()
    prompts, at = {}, 0
    for k in keys:
        prompts[k] = allp[at:at + len(sets[k])]
        at += len(sets[k])
    settings = settings_of(a, long_range, "held-out text" if has_tok else "random ids")
    runs, skipped, commands = _load_previous(a, settings)
    commands = [*commands, "python -m flashpd.bench.pd_benefit " + " ".join(argv)]
    gpus = gpu_info(a, configs)
    done = {(r["config"], r["method"], r["rate"]) for r in runs} | {(s["config"], s["method"], s["rate"])
                                                                    for s in skipped}

    def payload() -> dict:
        return {"kind": KIND, "complete": all((c, m, r) in done for c in configs for m in methods for r in rates),
                "settings": settings, "gpus": gpus, "commands": commands,
                **summary(runs, methods, a.slo_attainment), "runs": runs, "skipped": skipped}

    def save() -> None:  # no machine block here: write_json's initialises CUDA (only at the end)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(portable({"git": git_revision(), "partial": True, **payload()}), indent=2))

    out_of_time = False
    start_s = 60.0  # a configuration's start, until one is measured

    def over_budget(need_s: float) -> bool:
        nonlocal out_of_time
        if a.time_budget_s > 0 and time.monotonic() - t_start + need_s > a.time_budget_s:
            out_of_time = True
        return out_of_time

    with tempfile.TemporaryDirectory(prefix="flashpd-pd-benefit-") as tmp:
        for name in configs:
            todo = [(m, r) for m in methods for r in rates if (name, m, r) not in done]
            if not todo:
                log.info("%s: every rate measured (resumed)", name)
                continue
            if over_budget(start_s + a.requests / min(r for _, r in todo) + 10.0):  # a start and one rate
                break
            work = Path(tmp) / name
            work.mkdir()
            log.info("%s: starting %s", name, CONFIGS[name])
            t = time.monotonic()
            srv = ServeProcess(serve_config(a, name), work, a.start_timeout_s)
            start_s = time.monotonic() - t
            log.info("%s: listening on %s after %.1f s", name, srv.address, start_s)
            endpoints = worker_metrics(srv.log_path.read_text(errors="replace"))
            try:
                for m in methods:
                    if not [r for mm, r in todo if mm == m]:
                        continue
                    if warm:  # untimed
                        res, wall = run_open_loop(srv.address, prompts["warmup"], warm, m, a.request_timeout_s,
                                                  a.channels)
                        log.info("%s %s warm-up: %d requests in %.1f s", name, m, len(res), wall)
                        bad = [r.error for r in res if r.error]
                        if bad:
                            log.warning("%s %s warm-up: %d errors, first: %s", name, m, len(bad), bad[0])
                    stop = False
                    for rate in rates:
                        if (name, m, rate) in done:
                            prev = next((r for r in runs if (r["config"], r["method"], r["rate"]) == (name, m, rate)),
                                        None)
                            stop = stop or (prev is not None and prev["slo_attainment"] < a.stop_below)
                            continue
                        if stop:
                            skipped.append({"config": name, "method": m, "rate": rate,
                                            "reason": f"a lower rate's SLO attainment was below {a.stop_below}"})
                            done.add((name, m, rate))
                            save()
                            continue
                        if over_budget(a.requests / rate + 10.0):
                            break
                        before = scrape_counters(endpoints)
                        reqs, wall = run_open_loop(srv.address, prompts[rate], specs[rate], m, a.request_timeout_s,
                                                   a.channels)
                        row = {"config": name, "method": m, "rate": rate,
                               **summarize_rate(reqs, wall, a.ttft_slo_ms, a.tpot_slo_ms),
                               "worker_counters": counter_delta(scrape_counters(endpoints), before)}
                        if a.per_request:
                            row["per_request"] = [r.record() for r in reqs]
                        runs.append(row)
                        done.add((name, m, rate))
                        log.info("%s %s rate %s/s: ttft p50/p99 %s/%s ms, tpot p50/p99 %s/%s ms, itl p50/p99 %s/%s ms, "
                                 "%.1f tok/s, SLO %.0f%%, %d errors, tau %s", name, m, rate,
                                 *(_f(row[k][p]) for k in ("ttft_ms", "tpot_ms", "itl_ms") for p in ("p50", "p99")),
                                 row["output_tokens_per_s"] or 0, 100 * row["slo_attainment"], row["errors"],
                                 _f(row["tau"], 2))
                        save()
                        stop = row["slo_attainment"] < a.stop_below
                    if out_of_time:
                        break
            finally:
                srv.stop()
                shutil.copyfile(srv.log_path, f"{a.out}.serve-{name}.log")  # placement, worker errors
            if out_of_time:
                break
    if out_of_time:
        log.warning("--time-budget-s %.0f reached: partial; run the same command with --resume to go on",
                    a.time_budget_s)
    result = payload()
    return result, result["complete"]


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON to write (rewritten after every rate)")
    ap.add_argument("--target", help="Qwen3 directory; None: the shipped demo pair's target")
    ap.add_argument("--draft", help="DFlash drafter directory; None: the demo pair's (with its target), else none")
    ap.add_argument("--configs", default="replicas,1p1d-device,colocated", help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--methods", default="native,dflash", help="decoding methods, each at every rate")
    ap.add_argument("--rates", default="1,2,4,8,16", help="Poisson arrival rates, requests/s")
    ap.add_argument("--requests", type=int, default=64, help="requests per rate (and method and configuration)")
    ap.add_argument("--long-fraction", type=float, default=0.25, help="share of long prompts in each set")
    ap.add_argument("--short-tokens", default="128,512", help="short prompt lengths, LO,HI (uniform)")
    ap.add_argument("--long-tokens", default="2048,8192",
                    help="long prompt lengths, LO,HI (capped to fit the target's positions with the output)")
    ap.add_argument("--max-tokens", default="256", help="output tokens per request, N or LO,HI (uniform)")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT SLO")
    ap.add_argument("--tpot-slo-ms", type=float, default=30.0, help="TPOT SLO")
    ap.add_argument("--slo-attainment", type=float, default=0.9,
                    help="share of requests that must meet both SLOs for a rate to count towards goodput")
    ap.add_argument("--stop-below", type=float, default=0.5,
                    help="skip a (configuration, method)'s higher rates once its SLO attainment falls below this")
    ap.add_argument("--warmup", type=int, default=32,
                    help="untimed requests per configuration and method before its rates: the shortest and the "
                         "longest prompt at once, the rest of the mix arriving at the highest rate")
    ap.add_argument("--gpus", type=int, default=0,
                    help="use the first N visible GPUs (1: every configuration on GPU 0); 0: every visible GPU")
    ap.add_argument("--config", help="base serve config (JSON) the flags and configurations override")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="None: cuda when available")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="None: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--kv-cache-tokens", type=int, dest="kv_cache_tokens",
                    help="KV positions per worker (unset: half the free device memory at each worker's start)")
    ap.add_argument("--torch-threads", type=int, dest="torch_threads",
                    help="intra-op threads per worker; None: torch's")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="prompt positions per KV-bridge cache entry")
    ap.add_argument("--max-running", type=int, default=128, help="requests one decode worker batches at most")
    ap.add_argument("--channels", type=int, default=8, help="gRPC channels the request threads share")
    ap.add_argument("--seed", type=int, default=0, help="seeds prompt lengths, prompts and arrival times")
    ap.add_argument("--start-timeout-s", type=float, default=600.0, help="bound on one configuration's start")
    ap.add_argument("--request-timeout-s", type=float, default=300.0,
                    help="deadline of one request (past it: an error)")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="start nothing that would end past this many seconds (0: no bound); then --resume")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --out (same workload)")
    ap.add_argument("--per-request", action="store_true",
                    help="keep every request's record (chunk arrival times included) in the JSON")
    ap.add_argument("--plot", action="store_true", help="draw the charts beside the JSON (bench/plot_pd_benefit.py)")
    a = ap.parse_args(argv)
    if a.target is None:
        from flashpd.demo import PAIR  # noqa: PLC0415  (the shipped demo pair)

        a.target, a.draft = str(PAIR / "target"), a.draft or str(PAIR / "drafter")
    for n in _names(a.configs):
        if n not in CONFIGS:
            ap.error(f"--configs: unknown configuration {n!r} ({', '.join(CONFIGS)})")
    for m in _names(a.methods):
        if m not in ("native", "dflash"):
            ap.error(f"--methods: unknown method {m!r} (native, dflash)")
    if "dflash" in _names(a.methods) and not a.draft:
        ap.error("--methods dflash needs --draft")
    try:
        _rates(a.rates), _range(a.short_tokens), _range(a.long_tokens), _range(a.max_tokens)
    except ValueError as e:
        ap.error(str(e))
    if not 0 <= a.long_fraction <= 1 or a.requests < 1 or not 0 < a.slo_attainment <= 1:
        ap.error("--long-fraction in [0, 1], --requests >= 1, --slo-attainment in (0, 1]")
    return a


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    restrict_gpus(a.gpus)
    result, complete = sweep(a, argv)
    from flashpd.bench.common import write_json  # noqa: PLC0415  (initialises CUDA: after the services stopped)

    path = write_json(a.out, {**result, "partial": not complete})
    print(f"wrote {path}" + ("" if complete else " (partial: run again with --resume)"), flush=True)
    g = result["goodput"]
    print("goodput (req/s): " + "; ".join(f"{c} {m} {v}" for c in g for m, v in g[c].items()), flush=True)
    print(f"p99_itl_disagg_over_replicas ({result['p99_itl_disagg_over_replicas_method']}, "
          f"{result['p99_itl_disagg_over_replicas_config']}): {result['p99_itl_disagg_over_replicas']}", flush=True)
    if a.plot:
        from flashpd.bench.plot_pd_benefit import plot  # noqa: PLC0415

        for p in plot(path):
            print(f"drew {p}", flush=True)
    dead = [r for r in result["runs"] if r["errors"] == r["requests"]]
    if dead:
        print(f"{len(dead)} rate(s) with every request failed, e.g. {dead[0]['first_errors'][:1]}", flush=True)
        return 1
    return 0 if complete else 3


if __name__ == "__main__":
    sys.exit(main())

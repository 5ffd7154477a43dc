"""Load sweep through the gRPC API, as a `ray job submit` entrypoint (or a plain command).

    python -m flashpd.bench.job_sweep --out results.json [--modes colocated,disaggregated]
        [--methods native,dflash] [--concurrency 1,8,32,128] [--requests N] [--max-tokens 64]
        [--launcher ray|local] [--target DIR --draft DIR] [--address HOST:PORT]

For each mode it starts the service as `flashpd serve --config` in a child process (colocated:
one process; disaggregated: router + bridge + prefill + decode workers through the launcher:
Ray actors when ray is importable, else local processes), or uses a running one (--address).
For each method and concurrency it sends a fresh set of prompts (disjoint sets, the same across
modes, so the bridge never serves a prompt twice and the modes are compared on equal prompts)
and records TTFT and latency P50/P95, output tokens/s and tau, then checks that every mode gave
the same tokens for the same prompt (exact in float32; reported, not asserted, in bfloat16).
The JSON goes through flashpd.bench.common.write_json (git revision, machine, time, the command).

With --prompt-pool N the levels are compared on the same prompts instead: ONE pool of N prompts (made as
the disjoint sets are: held-out text for a pair with a tokenizer) and every level draws its requests from it
(`pool_sample`: a permutation of the pool seeded by --seed and the level, the same for every method and
mode; with --requests N, every level sends the whole pool). Difficulty then no longer varies with the level:
tau and tokens/s move with concurrency alone. Warm-ups still take prompts of their own, outside the pool. A
prompt that comes back must not be served from a cache: colocated, the sweep turns the service's prefix
cache off (no device or host cache tier); disaggregated, the KV bridge IS that cache (a prompt served before
is restored from it, so a repeat's TTFT is a hit's), which the JSON says (`prefix_cache` per run and in
`settings.prompt_pool`). With both methods, each level also compares native and DFlash tokens prompt by
prompt (`exact_methods`; exact in float32).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import re
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from flashpd.cluster.config import ServeConfig
from flashpd.bench.http_load import run_load_http
from flashpd.bench.load_gen import percentiles, run_load, summarize

# one client process drove every stream through one interpreter lock, and at the sweep's highest level it ran at
# its limit in both methods, so its figures there were partly the client's (bench/load_procs.py, docs/results.md)
STREAMS_PER_CLIENT_PROC = 32

log = logging.getLogger("flashpd.job_sweep")

def _demo_pair() -> Path:
    from flashpd.demo import PAIR  # noqa: PLC0415  (the shipped demo pair)

    return PAIR


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def default_launcher() -> str:
    """ray when it imports (a GPU machine may not have it), else the local launcher."""
    try:
        import ray  # noqa: F401, PLC0415
    except ImportError:
        return "local"
    del ray
    return "ray"


def prompt_lengths(n: int, length: int, long_every: int, long_tokens: int) -> list[int]:
    """Lengths of a set's n prompts: every long_every-th one (the first included) long_tokens long, so a
    set has long prompts where cache and transfer effects show (experiments.md); 0 turns them off."""
    return [long_tokens if long_every > 0 and i % long_every == 0 else length for i in range(n)]


def make_prompts(target: str, lengths: list[int], seed: int) -> list[list[int]]:
    """Disjoint prompts of the given lengths: held-out stdlib text when the target has a tokenizer
    (what the demo pair was trained on, so tau means something; too little of it is an error), else
    random ids."""
    import torch  # noqa: PLC0415

    from flashpd.engine.tokenizer import TextTokenizer  # noqa: PLC0415

    tok = TextTokenizer.from_dir(target)
    g = torch.Generator().manual_seed(seed)
    need = sum(lengths)
    if tok is not None:
        from flashpd.training.text_data import read_texts, split_files, stdlib_files  # noqa: PLC0415
        _, held = split_files(stdlib_files())
        order = torch.randperm(len(held), generator=g).tolist()
        stream: list[int] = []
        for k in order:
            stream.extend(tok.encode("".join(read_texts([held[k]]))))
            if len(stream) >= need:
                out, at = [], 0
                for n in lengths:
                    out.append(stream[at:at + n])
                    at += n
                return out
        # random ids would still run, but tau on them means nothing for a trained pair: refuse instead
        raise ValueError(f"the held-out text gives {len(stream)} tokens, fewer than the {need} these prompt sets "
                         f"need: lower --requests, --long-every's share or --prompt-tokens")
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    return [torch.randint(0, vocab - 2, (n,), generator=g).tolist() for n in lengths]


def pool_sample(pool_size: int, n: int, seed: int, level: int) -> list[int]:
    """Indices into the prompt pool of one level's n requests: a permutation of the pool seeded by (seed, level),
    repeated (a fresh permutation each time) while n exceeds the pool. The same for every method and mode."""
    rng = random.Random(f"flashpd-pool:{seed}:{level}")
    out: list[int] = []
    while len(out) < n:
        perm = list(range(pool_size))
        rng.shuffle(perm)
        out.extend(perm[:n - len(out)])
    return out


# only serve prints these to its stdout. Under Ray a forwarded actor log line can land on either side of one: before
# it (a copy that lacked its newline) or between it and its newline (print writes the text, then the newline)
_ANNOUNCED = re.compile(r"(http|listening) on (\S+:\d+)(?!\d)")


class ServeProcess:
    """`flashpd serve --config FILE` as a child; its address once it listens; stopped with a bound."""

    def __init__(self, cfg: ServeConfig, workdir: Path, start_timeout_s: float) -> None:
        path = workdir / f"serve-{cfg.mode}.json"
        path.write_text(json.dumps(cfg.to_dict()))
        self.log_path = workdir / f"serve-{cfg.mode}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "flashpd.cli", "serve", "--config", str(path)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            with open(self.log_path, "w") as f:
                for ln in self.proc.stdout:
                    f.write(ln)
                    f.flush()
                    lines.put(ln)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            self._wait_listening(lines, start_timeout_s, cfg)
        except BaseException:  # a SIGTERM or Ctrl-C during the start (model load, warm-up) stops the child too
            self.stop()
            raise

    def _wait_listening(self, lines: "queue.Queue[str | None]", start_timeout_s: float, cfg: ServeConfig) -> None:
        deadline = time.monotonic() + start_timeout_s
        self.address, self.http_address = None, None
        while self.address is None:
            left = deadline - time.monotonic()
            try:
                ln = lines.get(timeout=max(0.1, min(left, 1.0)))
            except queue.Empty:
                ln = ""
            if ln is None or left <= 0:
                self.stop()
                raise RuntimeError(f"flashpd serve ({cfg.mode}) did not start; log {self.log_path}:\n"
                                   + self.log_path.read_text()[-3000:])
            # searched, not matched at the line's start: under Ray the driver's copies of its actors' logs share
            # this stdout, and one that lacked its newline once took "listening on ..." into its own line
            m = _ANNOUNCED.search(ln)
            if m is not None and m.group(1) == "http":  # printed before "listening on"
                self.http_address = m.group(2)
            elif m is not None:
                self.address = m.group(2)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# --config keys that one mode alone takes (ServeConfig refuses them in the others): a sweep runs several modes
MODE_ONLY = {"num_gpus": "ray", "ray_address": "ray", "engine_process": "colocated"}
SIZE_DEFAULTS = {"prefill_workers": 1, "decode_workers": 1, "chunk_tokens": 256, "max_running": 128}


def client_procs(asked: int, concurrency: int) -> int:
    """Client processes for a level: `asked`, or with 0 one per STREAMS_PER_CLIENT_PROC streams (at least one)."""
    if asked < 0:
        raise ValueError(f"--client-procs: must be 0 (auto) or more, got {asked}")
    n = asked or -(-concurrency // STREAMS_PER_CLIENT_PROC)
    return max(1, min(n, concurrency))


def _cfg(a: argparse.Namespace, mode: str) -> ServeConfig:
    base = dict(a.base)  # --config's keys (parse_args); the sweep sets the mode, the ports and what they imply
    base.update(target=a.target, draft=a.draft, mode="colocated" if mode == "colocated" else a.launcher)
    for k, only in MODE_ONLY.items():
        if k in base and base["mode"] != only:
            dropped = base.pop(k)
            log.info("job_sweep: --config's %s (%r) does not apply to this sweep's %s mode", k, dropped,
                     base["mode"])
    for k in ("device", "dtype", "kv_cache_tokens", "torch_threads", "bridge_transport", "kv_transport",
              "draft_width_policy", "gil_switch_interval_s", "session_hold_fraction"):
        if getattr(a, k) is not None:
            base[k] = getattr(a, k)
    if a.prompt_pool and mode == "colocated":  # a pool's repeats must not be prefix-cache hits: no cache tier
        base.update(device_cache_bytes=0, host_cache_bytes=0)
    base.update(prefill_workers=a.prefill_workers, decode_workers=a.decode_workers, chunk_tokens=a.chunk_tokens,
                max_running=a.max_running, port=0, metrics_port=None,
                http_port=0 if "http" in _names(a.api) else base.get("http_port"))
    return ServeConfig.from_dict(base, "job_sweep")


UNKNOWN = "unknown (a running service that reports no settings)"


def _prefix_cache(a: argparse.Namespace, mode: str, service: dict | None = None) -> str:
    """What serves a prompt the service saw before, as the JSON states it (service: a running service's own
    settings, from its Health reply)."""
    if mode == "external":
        if service is None:
            return UNKNOWN
        if service.get("mode") != "colocated":
            return "bridge (a prompt served before is restored from the KV bridge)"
        tiers = service.get("device_cache_bytes") or service.get("host_cache_bytes")
        return "device/host cache tier" if tiers else "off"
    if mode == "colocated":
        cfg = _cfg(a, mode)
        return "device/host cache tier" if cfg.device_cache_bytes or cfg.host_cache_bytes else "off"
    return "bridge (a prompt served before is restored from the KV bridge)"


def service_settings(address: str, timeout_s: float) -> dict | None:
    """A running service's serving knobs (Health's settings_json; None from a server that reports none), so that
    a sweep against it records how it ran, as a sweep that starts its own service does."""
    from flashpd.cluster.generation_client import GenerationClient  # noqa: PLC0415

    with GenerationClient(address, timeout_s) as client:
        return client.health()["settings"]


def sweep(a: argparse.Namespace) -> dict:
    modes = ["external"] if a.address else _names(a.modes)
    apis = _names(a.api)
    levels = _ints(a.concurrency)
    counts = {c: (a.requests or (a.prompt_pool if a.prompt_pool else max(8, 2 * c))) for c in levels}
    methods = _names(a.methods)
    # default warm-up: c requests, and at least one long and one short prompt, so that both prompt
    # shapes' graphs are captured before the timed run (at c=1 a capture inside it was a 5 s outlier)
    warm = {c: (max(c, 2 * a.long_every) if a.long_every > 0 else c) if a.warmup < 0 else a.warmup
            for c in levels}
    # disjoint prompt sets per (method, concurrency) and for their warmups, shared by all modes
    # each set (warmups too, so they capture the long prompts' shapes) has its own long prompts;
    # with a pool, the timed sets are drawn from ONE set (the pool) instead
    timed = {} if a.prompt_pool else counts  # (the order of the keys is the order prompts are cut from the text)
    lens = {key: prompt_lengths(n, a.prompt_tokens, a.long_every, a.long_prompt_tokens)
            for m in methods for c in levels
            for key, n in (((m, c, "warmup"), warm[c]), ((m, c), timed.get(c))) if n is not None}
    if a.prompt_pool:
        lens["pool"] = prompt_lengths(a.prompt_pool, a.prompt_tokens, a.long_every, a.long_prompt_tokens)
    allp = make_prompts(a.target, [n for ls in lens.values() for n in ls], a.seed)
    sets, k = {}, 0
    for key, ls in lens.items():
        sets[key] = allp[k:k + len(ls)]
        k += len(ls)
    samples = {}
    if a.prompt_pool:
        pool = sets.pop("pool")
        for c in levels:
            samples[c] = pool_sample(a.prompt_pool, counts[c], a.seed, c)
            for m in methods:
                sets[(m, c)] = [pool[i] for i in samples[c]]
                lens[(m, c)] = [len(pool[i]) for i in samples[c]]
    runs, outputs = [], {}
    service = service_settings(a.address, a.request_timeout_s) if a.address else None
    if a.address:
        log.info("service at %s: %s", a.address, json.dumps(service, sort_keys=True) if service else UNKNOWN)

    first = None if a.address else _cfg(a, modes[0])  # the config the sweep's first service starts with

    def knob(name: str):
        """A serving knob as the JSON records it: the running service's own, or the one this sweep starts with."""
        if a.address:
            return service.get(name, UNKNOWN) if service else UNKNOWN
        return getattr(first, name)

    disagg = _cfg(a, "disaggregated") if "disaggregated" in modes else None

    with tempfile.TemporaryDirectory(prefix="flashpd-sweep-") as tmp:
        for mode in modes:
            srv = None if a.address else ServeProcess(_cfg(a, mode), Path(tmp), a.start_timeout_s)
            addresses = {"grpc": a.address or srv.address, "http": a.http_address or (srv and srv.http_address)}
            if "http" in apis and not addresses["http"]:
                raise RuntimeError("--api http: the service serves no HTTP API (give --http-address, or let the sweep "
                                   "start it)")
            try:
                for m, c, api in ((m, c, api) for m in methods for c in levels for api in apis):
                    kw = dict(max_tokens=a.max_tokens, method=m, ignore_eos=True)
                    load = run_load if api == "grpc" else run_load_http
                    procs = client_procs(a.client_procs, c)
                    if sets[(m, c, "warmup")]:  # compiles / captures this level's batch shapes first
                        load(addresses[api], sets[(m, c, "warmup")], min(c, warm[c]), a.request_timeout_s,
                             procs=client_procs(a.client_procs, min(c, warm[c])), **kw)
                    res, wall = load(addresses[api], sets[(m, c)], c, a.request_timeout_s, procs=procs, **kw)
                    row = {"mode": mode, "api": api, "method": m, "concurrency": c, **summarize(res, wall),
                           "prefix_cache": _prefix_cache(a, mode, service), "client_procs": procs}
                    if a.prompt_pool:
                        row["prompt_pool"] = {"size": a.prompt_pool, "seed": a.seed,
                                              "distinct_prompts": len(set(samples[c]))}
                    if a.long_every > 0:  # the long prompts' own TTFT: where transfer and prefill show
                        row["ttft_long_ms"] = percentiles([r.ttft_ms for r, n in zip(res, lens[(m, c)])
                                                           if n == a.long_prompt_tokens and r.error is None])
                    log.info("%s %s %s c=%d: ttft p50 %.1f ms, latency p50 %.1f ms, %.1f tok/s, tau %s, %d errors",
                             mode, api, m, c, row["ttft_ms"]["p50"] or -1, row["latency_ms"]["p50"] or -1,
                             row["output_tokens_per_s"] or 0, row["tau"], row["errors"])
                    runs.append(row)
                    outputs[(_variant(mode, api), m, c)] = [r.tokens if r.error is None else None for r in res]
                    # a sweep cut short (a time limit) still leaves every level it finished
                    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(a.out).write_text(json.dumps({"kind": "serve_sweep", "partial": True, "runs": runs}))
            finally:
                if srv is not None:
                    srv.stop()
                    # the service's own log (placement, worker errors) outlives the temporary directory
                    shutil.copyfile(srv.log_path, f"{a.out}.serve-{mode}.log")
    variants = [_variant(mode, api) for mode in modes for api in apis]
    out = {"kind": "serve_sweep", "runs": runs, "exact": _exactness(outputs, variants)}
    if a.prompt_pool and {"native", "dflash"} <= set(methods):
        out["exact_methods"] = _method_exactness(outputs, variants, levels)
    return {**out,
            "settings": {"target": a.target, "draft": a.draft, "modes": modes, "methods": methods,
                         "concurrency": levels, "requests": counts, "warmup": warm, "max_tokens": a.max_tokens,
                         "prompt_tokens": a.prompt_tokens, "long_every": a.long_every,
                         "long_prompt_tokens": a.long_prompt_tokens, "launcher": a.launcher,
                         "device": knob("device"), "dtype": knob("dtype"), "prefill_workers": a.prefill_workers,
                         "decode_workers": a.decode_workers, "chunk_tokens": a.chunk_tokens,
                         # the disaggregated mode's own, where it ran (a colocated-only config may not suit it)
                         "bridge_transport": knob("bridge_transport") if a.address else
                         disagg.bridge_transport if disagg else None,
                         "kv_transport": knob("kv_transport") if a.address else disagg.kv_transport if disagg else None,
                         "apis": apis,
                         "max_running": knob("max_running"),
                         "gil_switch_interval_s": knob("gil_switch_interval_s"),
                         "session_hold_fraction": knob("session_hold_fraction"),
                         "client_procs": a.client_procs or f"auto (one per {STREAMS_PER_CLIENT_PROC} streams)",
                         "draft_width_policy": knob("draft_width_policy"),
                         "service": service if a.address else None,
                         "prompt_pool": ({"size": a.prompt_pool, "seed": a.seed,
                                          "rule": "every level's requests are pool_sample(size, requests, seed, "
                                                  "level) of one pool; the same for every method and mode",
                                          "prefix_cache": {mode: _prefix_cache(a, mode, service) for mode in modes},
                                          "samples": {c: samples[c] for c in levels}}
                                         if a.prompt_pool else None)}}


def _variant(mode: str, api: str) -> str:
    """A (mode, front door) pair's name in the exactness check: the mode itself for gRPC."""
    return mode if api == "grpc" else f"{mode}/{api}"


def _exactness(outputs: dict, modes: list[str]) -> dict:
    """Per (method, concurrency): do all modes give the same tokens for the same prompt?"""
    compared = same = 0
    mismatches = []
    for (mode, m, c), toks in outputs.items():
        if mode != modes[0]:
            continue
        for other in modes[1:]:
            for i, (x, y) in enumerate(zip(toks, outputs[(other, m, c)])):
                if x is None or y is None:
                    continue
                compared += 1
                if x == y:
                    same += 1
                elif len(mismatches) < 10:
                    first = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                    mismatches.append({"modes": [mode, other], "method": m, "concurrency": c, "prompt": i,
                                       "first_difference_at": first})
    return {"compared": compared, "identical": same, "match_rate": same / compared if compared else None,
            "mismatches": mismatches}


def _method_exactness(outputs: dict, variants: list[str], levels: list[int]) -> dict:
    """Per (variant, concurrency) of a pooled sweep: do native and DFlash give the same tokens for each prompt
    (the same prompts, in the same order)?"""
    out = {}
    for v in variants:
        for c in levels:
            pairs = [(x, y) for x, y in zip(outputs.get((v, "native", c), []), outputs.get((v, "dflash", c), []))
                     if x is not None and y is not None]
            same = sum(x == y for x, y in pairs)
            out[f"{v} c={c}"] = {"compared": len(pairs), "identical": same,
                                 "match_rate": same / len(pairs) if pairs else None}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--target", help="Qwen3 directory (default: the shipped demo pair's target)")
    ap.add_argument("--draft", help="DFlash drafter directory (default: the demo pair's, with its target)")
    ap.add_argument("--modes", default="colocated,disaggregated")
    ap.add_argument("--methods", default="native,dflash")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--requests", type=int, default=0,
                    help="per concurrency level and method (0: max(8, 2c); with --prompt-pool: the pool's size)")
    ap.add_argument("--prompt-pool", type=int, default=0, dest="prompt_pool",
                    help="N > 0: every level draws its requests from ONE pool of N prompts (seeded by --seed and the "
                         "level, the same for every method), so that levels differ in concurrency alone; colocated, "
                         "the prefix cache is off (module doc). 0: a disjoint prompt set per level and method")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--long-every", type=int, default=0,
                    help="every Nth prompt of a set (the first included) is --long-prompt-tokens long; 0: none")
    ap.add_argument("--long-prompt-tokens", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=-1,
                    help="untimed requests before each level, at its concurrency (-1: as many as the concurrency, and "
                         "at least two sets of --long-every prompts)")
    ap.add_argument("--launcher", choices=["ray", "local"], default=None,
                    help="for the disaggregated mode (default: ray when importable, else local)")
    ap.add_argument("--address", help="measure a running service instead of starting one")
    ap.add_argument("--http-address", dest="http_address",
                    help="the running service's HTTP API (HOST:PORT), with --address and --api http")
    ap.add_argument("--api", default="grpc",
                    help="front doors to drive, each level through each: grpc, http (the OpenAI-compatible API), or "
                         "grpc,http (the sweep's service then serves both)")
    ap.add_argument("--config", help="base serve config (JSON or YAML, as `flashpd serve` reads it); flags given "
                                     "override it; mode, ports and the mode-only keys are the sweep's own")
    ap.add_argument("--device", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-tokens", type=int, dest="kv_cache_tokens")
    ap.add_argument("--draft-width-policy", dest="draft_width_policy",
                    help="the serve config's draft_width_policy (engine/width_policy.py), e.g. batch:caps=1-16/65-1 "
                         "(no speculation from 65 DFlash rows a step)")
    ap.add_argument("--torch-threads", type=int, dest="torch_threads")
    ap.add_argument("--session-hold-fraction", type=float, dest="session_hold_fraction",
                    help="the service's ServeConfig.session_hold_fraction (engine/scheduler.py)")
    ap.add_argument("--gil-switch-interval-s", type=float, dest="gil_switch_interval_s",
                    help="the service's sys.setswitchinterval (ServeConfig.gil_switch_interval_s)")
    ap.add_argument("--bridge-transport", choices=["inline", "shm", "arena"], dest="bridge_transport",
                    help="how KV chunks move between workers and the bridge: in the gRPC messages, or through "
                         "shared memory with gRPC carrying handles (same host)")
    ap.add_argument("--kv-transport", choices=["bridge", "device"], dest="kv_transport",
                    help="how a prefill's KV reaches its decode worker: through the bridge, or (same host) by the "
                         "device path, the decode worker copying the prefill worker's blocks")
    # None: the --config file's value, else SIZE_DEFAULTS (a flag given wins over the file, an unset one does not)
    ap.add_argument("--prefill-workers", type=int, help=f"default: --config's, else {SIZE_DEFAULTS['prefill_workers']}")
    ap.add_argument("--decode-workers", type=int, help=f"default: --config's, else {SIZE_DEFAULTS['decode_workers']}")
    ap.add_argument("--chunk-tokens", type=int, help=f"default: --config's, else {SIZE_DEFAULTS['chunk_tokens']}")
    ap.add_argument("--max-running", type=int, help=f"default: --config's, else {SIZE_DEFAULTS['max_running']}")
    ap.add_argument("--client-procs", type=int, default=0, dest="client_procs",
                    help="load generator processes a level (bench/load_procs.py); 0: one per "
                         f"{STREAMS_PER_CLIENT_PROC} streams")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    if not Path(a.out).is_absolute() and "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
        ap.error("--out: a relative path inside a Ray job lands in Ray's temporary copy of the working_dir; give an "
                 "absolute path on the head node (\"$PWD/bench/results/NAME.json\" when the head is this machine)")
    a.launcher = a.launcher or default_launcher()
    a.base = {}
    if a.config:
        from flashpd.cluster.config import read_config_dict  # noqa: PLC0415

        try:
            a.base = read_config_dict(a.config)
        except (OSError, ValueError) as e:
            ap.error(f"--config: {e}")
        if not isinstance(a.base, dict):
            ap.error(f"--config: {a.config}: must be a mapping of serve config keys")
        a.target = a.target or a.base.get("target")
        a.draft = a.draft or (a.base.get("draft") if a.target == a.base.get("target") else None)
    for k, v in SIZE_DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, a.base.get(k, v))
    if min(_ints(a.concurrency) or [0]) < 1:
        ap.error(f"--concurrency: levels must be >= 1, got {a.concurrency!r}")
    if a.target is None:
        a.target, a.draft = str(_demo_pair() / "target"), a.draft or str(_demo_pair() / "drafter")
    for api in _names(a.api):
        if api not in ("grpc", "http"):
            ap.error(f"--api: unknown front door {api!r} (grpc, http)")
    for m in _names(a.modes):
        if m not in ("colocated", "disaggregated"):
            ap.error(f"--modes: unknown mode {m!r} (colocated, disaggregated)")
    if a.prompt_pool < 0:
        ap.error("--prompt-pool: must be >= 0")
    if a.draft_width_policy is not None:
        from flashpd.engine.width_policy import parse_width_policy  # noqa: PLC0415

        try:
            parse_width_policy(a.draft_width_policy)
        except ValueError as e:
            ap.error(f"--draft-width-policy: {e}")
    return a


def _terminate(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    # a plain SIGTERM (kill, a scheduler) unwinds: the sweep's `finally` stops the `flashpd serve` it started,
    # which otherwise went on serving, reparented, with its temporary directory
    signal.signal(signal.SIGTERM, _terminate)
    result = sweep(a)
    from flashpd.bench.common import write_json  # noqa: PLC0415  (imports torch: after the sweep's children)

    path = write_json(a.out, result)
    print(f"wrote {path}", flush=True)
    bad = [r for r in result["runs"] if r["errors"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

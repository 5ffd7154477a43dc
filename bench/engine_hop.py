"""What the colocated engine's own process costs a request at concurrency 1, without gRPC in between.

    python -m flashpd.bench.engine_hop --requests 200 --max-tokens 16 --out engine_hop.json

Two backends over one model pair, built once each: the decode worker's EngineLoop in this process (the
`engine_process: false` service) and an EngineProcess (cluster/engine_proc.py, the default). One request at a time,
alternating rounds, each form times, from the submit call as a front end sees it: the submit's return (the
engine took it), the first "tokens" event taken from the handle, and the "done" event. Medians per round; every
request's tokens must be the same in both forms (the JSON's `same_tokens`). The service sweep's c=1 level measures
the same path through the gRPC front end (docs/results.md, "Service sweeps").
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

from flashpd.bench.common import command_line, git_revision, machine, write_json
from flashpd.demo import PAIR

log = logging.getLogger("flashpd.engine_hop")
DEMO = PAIR  # flashpd/assets/demo_pair, wherever the package is installed
EVENT_TIMEOUT_S = 60.0


def one(backend, prompt: list[int], params, method: str) -> tuple[float, float, float, list[int]]:
    """(taken, first token event, done) in ms from the submit call, and the tokens."""
    t0 = time.perf_counter()
    h = backend.submit(prompt, params, method, None, timeout_s=EVENT_TIMEOUT_S)
    taken = time.perf_counter() - t0
    first, toks = None, []
    while True:
        ev = h.get(EVENT_TIMEOUT_S)
        if ev is None:
            raise TimeoutError(f"no event within {EVENT_TIMEOUT_S:g} s")
        if ev.kind == "tokens":
            first = first if first is not None else time.perf_counter() - t0
            toks.extend(ev.tokens)
        elif ev.kind == "done":
            return taken * 1e3, first * 1e3, (time.perf_counter() - t0) * 1e3, toks
        else:
            raise RuntimeError(f"request ended with {ev.kind}: {ev.error}")


def build(cfg, form: str):
    """(backend, closer) for a form: "in_process" (DecodeWorker's loop) or "engine_process" (EngineProcess)."""
    if form == "engine_process":
        from flashpd.cluster.engine_proc import EngineProcess  # noqa: PLC0415
        e = EngineProcess(cfg)
        return e, e.stop
    from flashpd.cluster.metrics import Metrics  # noqa: PLC0415
    from flashpd.cluster.worker_main import build_decode, load_model  # noqa: PLC0415
    w = build_decode(cfg, load_model(cfg), None, Metrics("bench"))
    return w.loop, w.stop


def main(argv: list[str] | None = None) -> dict:
    from flashpd.cluster.config import ServeConfig  # noqa: PLC0415
    from flashpd.engine.sampling import SamplingParams  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "drafter"), help="'' for none (native only)")
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--kv-cache-tokens", type=int, default=65536, help="per form (both hold a cache at once)")
    ap.add_argument("--methods", default="native,dflash")
    ap.add_argument("--requests", type=int, default=100, help="per form, method and round")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", choices=("auto", "on", "off"), default="auto",
                    help="the decode worker's warm-up in both forms (auto: on a GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    warm = {"auto": None, "on": True, "off": False}[a.warmup]
    cfg = ServeConfig(target=a.target, draft=a.draft or None, device=a.device, dtype=a.dtype,
                      kv_cache_tokens=a.kv_cache_tokens, max_running=8, warmup=warm)
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(a.seed)
    backends = {}
    try:
        for form in ("in_process", "engine_process"):
            t0 = time.perf_counter()
            backends[form] = build(cfg, form)
            log.info("%s ready in %.1f s", form, time.perf_counter() - t0)
        vocab = backends["in_process"][0].vocab_size
        prompts = [torch.randint(5, vocab, (a.prompt_tokens,), generator=g).tolist() for _ in range(a.requests)]
        params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
        methods = [m for m in a.methods.split(",") if m]
        rows, tokens = [], {}
        for rnd in range(a.rounds):
            for method in methods:
                for form in ("in_process", "engine_process"):
                    be = backends[form][0]
                    one(be, prompts[0], params, method)  # each row starts warm
                    got = [one(be, p, params, method) for p in prompts]
                    for i, (*_, toks) in enumerate(got):
                        tokens.setdefault((rnd, method, i), {})[form] = toks
                    row = {"round": rnd, "form": form, "method": method, "requests": len(got)}
                    for k, name in enumerate(("taken_ms", "first_token_ms", "done_ms")):
                        row[f"{name}_p50"] = statistics.median(x[k] for x in got)
                    rows.append(row)
                    log.info("round %d %s %s: taken %.3f ms, first token %.3f ms, done %.3f ms", rnd, method, form,
                             row["taken_ms_p50"], row["first_token_ms_p50"], row["done_ms_p50"])
    finally:
        for _, close in backends.values():
            close()
    same = sum(v["in_process"] == v["engine_process"] for v in tokens.values())
    summary = {}
    for method in methods:
        for form in ("in_process", "engine_process"):
            mine = [r for r in rows if r["method"] == method and r["form"] == form]
            summary[f"{method} {form}"] = {k: statistics.median(r[k] for r in mine)
                                           for k in ("taken_ms_p50", "first_token_ms_p50", "done_ms_p50")}
    out = {"bench": "engine_hop", "git": git_revision(), "machine": machine(),
           "command": command_line("flashpd.bench.engine_hop", argv),
           "settings": {k: v for k, v in vars(a).items() if k != "out"}, "rows": rows, "summary": summary,
           "same_tokens": f"{same}/{len(tokens)}"}
    write_json(a.out, out)
    log.info("same tokens in both forms: %s; wrote %s", out["same_tokens"], a.out)
    return out


if __name__ == "__main__":
    main()

"""The engine alone under a service's closed loop: what the decode scheduler sustains without a front end.

    python -m flashpd.bench.closed_loop --concurrency 32,128 --hold-fractions 0,0.25 --out closed_loop.json

A decode worker's scheduler (decode_node/scheduler.py, policy "preempt", max_running the largest level), warmed up
as a worker warms up (engine/warmup.py), runs c requests in flight: each finished request is replaced at once by
the next from one pool of prompts (cut from the sweep's held-out text, bench/job_sweep.make_prompts, each level's
order by its `pool_sample`), as the sweep's clients do but
with no gRPC, no threads and no client in between. Per configuration (session hold fraction, method, level) it
reports tokens a second, the step time, the device-loop sessions ended and the requests admitted, and how many
steps a finished request's end waited (Scheduler.hold_fraction), and the CUDA graphs captured inside the level.
Requests are greedy unless --temperature (and --top-p, --top-k) say otherwise. The service sweep measures the same loop
through the front end; the gap between the two is the front end's and the interpreter lock's
(docs/results.md, "Service sweeps").

Rounds alternate over configurations (every configuration once per round), so that a machine's drift falls on
all alike; the first round of each configuration also meets any shape the warm-up did not (its graphs_captured).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from flashpd.bench.common import command_line, write_json
from flashpd.demo import PAIR
from flashpd.bench.job_sweep import make_prompts, pool_sample, prompt_lengths

log = logging.getLogger("flashpd.closed_loop")
DEMO = PAIR  # flashpd/assets/demo_pair, wherever the package is installed


def run_level(sched, pool: list[list[int]], order: list[int], conc: int, method: str, params) -> dict:
    """One closed loop of len(order) requests, conc in flight, each with `params` (SamplingParams; sampled, each
    request's seed is params.seed plus its prompt's index in the pool, so a round samples as the last one did);
    the scheduler is idle before and after. graphs_captured: CUDA graphs captured inside the level (shapes the
    warm-up did not meet; each a stall of the batch in flight)."""
    import dataclasses  # noqa: PLC0415

    from flashpd.engine import cuda_graph  # noqa: PLC0415

    ends0, adm0, graphs0 = sched.sessions_ended, sched.admitted, cuda_graph.captures()
    reqs, sent, done, tokens, steps = {}, 0, 0, 0, 0
    last_token: dict[int, int] = {}
    waits: list[int] = []
    cuda = sched.runner.device.type == "cuda"

    def send() -> None:
        nonlocal sent
        i = order[sent]
        sp = params if params.greedy else dataclasses.replace(params, seed=(params.seed or 0) + i)
        r = sched.add(pool[i], sp, method)
        reqs[r.id] = r
        sent += 1

    t0 = time.perf_counter()
    for _ in range(min(conc, len(order))):
        send()
    while done < len(order):
        res = sched.step()
        steps += 1
        tokens += sum(len(t) for t in res.new_tokens.values())
        for rid in res.new_tokens:
            if reqs[rid].seq.done:
                last_token.setdefault(rid, steps)
        for r in res.finished:
            waits.append(steps - last_token.get(r.id, steps))
            done += 1
            if sent < len(order):
                send()
        for r, err in res.failed:
            raise RuntimeError(f"request {r.id} failed in the closed loop: {err}")
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"requests": len(order), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "steps": steps, "ms_per_step": wall * 1e3 / steps, "sessions_ended": sched.sessions_ended - ends0,
            "admitted": sched.admitted - adm0, "graphs_captured": cuda_graph.captures() - graphs0,
            "end_wait_steps": {"mean": statistics.fmean(waits), "max": max(waits)},
            "tau": _tau(reqs.values()) if method == "dflash" else None}


def _tau(reqs) -> float | None:
    acc = [a for r in reqs for a in r.seq.stats.acceptance_lengths]
    return sum(acc) / len(acc) if acc else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "drafter"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kv-cache-tokens", type=int, default=262144, dest="kv_cache_tokens")
    ap.add_argument("--concurrency", default="32,128")
    ap.add_argument("--methods", default="native,dflash")
    ap.add_argument("--hold-fractions", default="0", dest="hold_fractions",
                    help="Scheduler.hold_fraction values to compare (0: a session restarts at each finish)")
    ap.add_argument("--hold-steps", type=int, default=4, dest="hold_steps")
    ap.add_argument("--requests", type=int, default=0, help="per level (0: three times its concurrency)")
    ap.add_argument("--prompt-pool", type=int, default=256, dest="prompt_pool")
    ap.add_argument("--prompt-tokens", type=int, default=128, dest="prompt_tokens")
    ap.add_argument("--max-tokens", type=int, default=64, dest="max_tokens")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's (0: greedy; an HTTP request's default is 1.0, or the target's "
                         "generation_config.json)")
    ap.add_argument("--top-p", type=float, default=1.0, dest="top_p")
    ap.add_argument("--top-k", type=int, default=0, dest="top_k")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", choices=["auto", "on", "off"], default="auto",
                    help="the decode worker's warm-up first (auto: on a GPU)")
    ap.add_argument("--seed", type=int, default=0, help="the prompt pool, each level's order, and sampled requests' seeds")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from flashpd.decode_node.scheduler import Scheduler  # noqa: PLC0415
    from flashpd.engine.factory import load_engine  # noqa: PLC0415
    from flashpd.engine.sampling import SamplingParams  # noqa: PLC0415
    from flashpd.engine.warmup import lengths_for, warm_scheduler  # noqa: PLC0415

    levels = [int(x) for x in a.concurrency.split(",")]
    methods = [m for m in a.methods.split(",") if m]
    holds = [float(x) for x in a.hold_fractions.split(",")]
    if any(not 0 <= h <= 1 for h in holds):
        raise SystemExit("--hold-fractions: each must be in [0, 1]")
    try:  # refused before the model loads (a temperature < 0, a top_p outside (0, 1])
        params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, temperature=a.temperature, top_p=a.top_p,
                                top_k=a.top_k, seed=a.seed)
        params.validate()
    except ValueError as e:
        raise SystemExit(f"closed_loop: {e}") from None
    llm = load_engine(a.target, a.draft if "dflash" in methods else None, device=a.device, dtype=a.dtype,
                      kv_cache_tokens=a.kv_cache_tokens)
    sched = Scheduler(llm.runner, llm.drafter, tuple(llm.stop_ids), None, max(levels), "preempt")
    warm = None
    if a.warmup == "on" or (a.warmup == "auto" and llm.runner.device.type == "cuda"):
        spec = sched.spec
        new = 2 * (spec.draft_width if spec is not None else 16) + 1  # as DecodeWorker warms up
        warm = warm_scheduler(sched, lengths_for(llm.runner.max_positions, new), new)
        log.info("warm-up: %d requests in %.1f s", warm["requests"], warm["seconds"])
    pool = make_prompts(a.target, prompt_lengths(a.prompt_pool, a.prompt_tokens, 0, 0), a.seed)
    configs = [(h, m, c) for h in holds for m in methods for c in levels]
    rows: dict[tuple, list[dict]] = {k: [] for k in configs}
    for rnd in range(a.rounds):
        for h, m, c in configs:
            sched.hold_fraction, sched.hold_steps = h, a.hold_steps
            order = pool_sample(a.prompt_pool, a.requests or 3 * c, a.seed, c)
            row = run_level(sched, pool, order, c, m, params)
            rows[(h, m, c)].append(row)
            log.info("round %d hold %.2f %s c=%d: %.0f tokens/s, %.2f ms a step, %d sessions ended, %d graphs "
                     "captured, tau %s", rnd, h, m, c, row["tokens_per_s"], row["ms_per_step"], row["sessions_ended"],
                     row["graphs_captured"], row["tau"])
    free = llm.runner.allocator.num_free
    if free != sched.capacity:
        raise RuntimeError(f"the closed loops leaked KV blocks ({sched.capacity - free})")
    results = [{"hold_fraction": h, "method": m, "concurrency": c, "rounds": rs,
                "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs)}
               for (h, m, c), rs in rows.items()]
    write_json(a.out, {"bench": "closed_loop", "command": command_line("flashpd.bench.closed_loop", argv),
                       "settings": {k: v for k, v in vars(a).items() if k != "out"},
                       "warmup": {k: warm[k] for k in ("requests", "seconds")} if warm else None,
                       "results": results})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

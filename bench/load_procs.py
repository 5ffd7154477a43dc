"""A closed-loop load spread over client processes, so that the load generator is not what a sweep measures.

One Python process drives every stream through its own interpreter lock. On the H200 the sweep's one client
process ran at a full core through the concurrency-128 levels of both methods (docs/results.md, "Service
sweeps"): a load generator at its limit measures itself, not the service.
Here `procs` processes (spawned, so none inherits a gRPC channel or a lock) each run `concurrency / procs` client
threads (the remainder to the first ones) over one shared counter of prompt indices, so requests are still taken
in order by whichever client is free, as in one process. Every process connects first; the parent starts the
clock when all are ready, and the run ends at the last client's end (one machine's monotonic clock, which every
process reads). A client process that cannot start fails the run (fewer clients would be another load); one
that dies later, or never reports, marks its requests failed, and the run still ends. A request whose client
raises is failed alone.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from typing import Callable

from flashpd.bench.load_gen import RequestResult

# how a client thread is built in a client process: module-level functions, so spawned processes import them
#   factory(target, timeout_s, request_kw) -> (one thread's context manager, one request: (ctx, prompt, r) -> None)
ClientFactory = Callable[[str, float, dict], tuple[Callable[[], object], Callable[[object, object, RequestResult],
                                                                                   None]]]

READY_TIMEOUT_S = 120.0  # a spawned client process imports, then connects before the clock starts


def split(concurrency: int, procs: int) -> list[int]:
    """Client threads per process: concurrency over min(procs, concurrency) processes, the remainder first."""
    n = max(1, min(procs, concurrency))
    return [concurrency // n + (1 if k < concurrency % n else 0) for k in range(n)]


def _child(factory: ClientFactory, target: str, prompts: list, threads: int, timeout_s: float, request_kw: dict,
           counter, ready, go, out) -> None:
    """One client process: `threads` clients taking prompt indices from the shared counter until none are left."""
    try:
        open_ctx, one = factory(target, timeout_s, request_kw)
        results: dict[int, RequestResult] = {}
        lock = threading.Lock()

        def take() -> int | None:
            with counter.get_lock():
                i = counter.value
                if i >= len(prompts):
                    return None
                counter.value = i + 1
            r = RequestResult(i)
            with lock:
                results[i] = r
            return i

        def client(ctx) -> None:
            with ctx:
                while (i := take()) is not None:
                    try:
                        one(ctx, prompts[i], results[i])
                    except Exception as e:  # noqa: BLE001  this request failed; the client goes on
                        results[i].error = f"client error: {type(e).__name__}: {e}"

        ctxs = [open_ctx() for _ in range(threads)]
        ready.put(("ready", None))
        go.wait()
        workers = [threading.Thread(target=client, args=(c,), daemon=True) for c in ctxs]
        for w in workers:
            w.start()
        deadline = time.monotonic() + timeout_s * (len(prompts) // max(threads, 1) + 1) + 30
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
        end = time.perf_counter()
        with lock:
            done = list(results.values())
        for r in done:
            if r.latency_ms is None and r.error is None:
                r.error = "not finished when the run's bound passed"
        out.put(("done", (end, done)))
    except BaseException as e:  # noqa: BLE001  the parent marks this process's requests failed
        try:
            ready.put(("failed", f"{type(e).__name__}: {e}"))
        finally:
            out.put(("failed", f"{type(e).__name__}: {e}"))


def run_in_procs(factory: ClientFactory, target: str, prompts: list, concurrency: int, procs: int,
                 timeout_s: float, request_kw: dict) -> tuple[list[RequestResult], float]:
    """Every prompt once over `procs` client processes; results in prompt order and the run's wall time (s)."""
    ctx = mp.get_context("spawn")
    counter, go = ctx.Value("q", 0), ctx.Event()
    ready, out = ctx.Queue(), ctx.Queue()
    shares = split(concurrency, procs)
    children = [ctx.Process(target=_child, args=(factory, target, prompts, k, timeout_s, request_kw, counter, ready,
                                                 go, out), daemon=True, name=f"load-{j}") for j, k in enumerate(shares)]
    for c in children:
        c.start()
    failures: list[str] = []
    try:
        for _ in children:
            kind, why = ready.get(timeout=READY_TIMEOUT_S)
            if kind == "failed":
                failures.append(why)
    except queue.Empty:
        failures.append(f"a client process was not ready within {READY_TIMEOUT_S:g} s")
    if failures:  # fewer clients than asked would measure another load: refuse the run
        for c in children:
            c.kill()
        raise RuntimeError(f"a load client process failed to start: {'; '.join(failures)}")
    t0 = time.perf_counter()
    go.set()
    results = {i: RequestResult(i) for i in range(len(prompts))}
    ends: list[float] = []
    bound = time.monotonic() + timeout_s * (len(prompts) // max(min(shares), 1) + 1) + 60
    reported = 0
    while reported < len(children) and time.monotonic() < bound:
        try:
            kind, payload = out.get(timeout=1.0)
        except queue.Empty:
            if not any(c.is_alive() for c in children) and out.empty():
                break
            continue
        reported += 1
        if kind == "failed":
            failures.append(payload)
            continue
        end, done = payload
        ends.append(end)
        for r in done:
            results[r.index] = r
    wall = (max(ends) if ends else time.perf_counter()) - t0
    for c in children:
        c.join(5.0)
        if c.is_alive():
            c.kill()
    why = "; ".join(failures) or "its client process never reported"
    for r in results.values():
        if r.latency_ms is None and r.error is None:
            r.error = f"not run: {why}" if not r.tokens else f"not finished: {why}"
    return [results[i] for i in range(len(prompts))], wall

"""Closed-loop load through the generation gRPC API: `concurrency` clients, each streaming one
request after another until the requests run out; TTFT and latency measured at the client.

Every client has its own channel and its own deadline per request; a request that fails is
recorded with its error, never retried, and the run still ends (each wait is bounded).
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

from flashpd.cluster.generation_client import GenerationClient, GenerationError


@dataclass
class RequestResult:
    index: int
    tokens: list[int] = field(default_factory=list)
    ttft_ms: float | None = None
    latency_ms: float | None = None
    acceptance_lengths: list[int] = field(default_factory=list)
    prefill_ms: float | None = None  # the service's own figure (disaggregated: the prefill worker's prefill)
    service_ttft_ms: float | None = None  # TTFT as the service saw it (router or engine loop): the rest is transport
    error: str | None = None


def run_load(address: str, prompts: list[list[int]], concurrency: int, timeout_s: float = 300.0, procs: int = 1,
             **request_kw) -> tuple[list[RequestResult], float]:
    """Send every prompt once (request_kw: max_tokens, method, ignore_eos, ...); returns the results
    in prompt order and the wall time of the whole run in seconds. procs > 1: the clients run in that many
    processes (bench/load_procs.py says why)."""
    return run_closed_loop(grpc_clients, address, prompts, concurrency, timeout_s, procs, request_kw, "load")


def run_closed_loop(factory, target: str, prompts: list, concurrency: int, timeout_s: float, procs: int,
                    request_kw: dict, name: str) -> tuple[list[RequestResult], float]:
    """`concurrency` clients built by `factory` (load_procs.ClientFactory: gRPC or HTTP), each taking the next
    prompt until none is left; in this process, or over `procs` client processes."""
    if procs > 1:
        from flashpd.bench.load_procs import run_in_procs  # noqa: PLC0415
        return run_in_procs(factory, target, prompts, concurrency, procs, timeout_s, request_kw)
    open_client, one = factory(target, timeout_s, request_kw)
    results = [RequestResult(i) for i in range(len(prompts))]
    nxt = iter(range(len(prompts)))
    lock = threading.Lock()

    def client() -> None:
        with open_client() as c:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                one(c, prompts[i], results[i])

    return run_clients(client, concurrency, results, timeout_s, name)


def grpc_clients(address: str, timeout_s: float, request_kw: dict):
    """A client thread's channel (opened per thread) and one streamed request through it (load_procs'
    ClientFactory: module level, so a spawned client process can build it)."""
    def open_client() -> GenerationClient:
        return GenerationClient(address, timeout_s=timeout_s)

    def one(c: GenerationClient, prompt: list[int], r: RequestResult) -> None:
        t0 = time.perf_counter()
        try:
            for ch in c.generate(prompt, **request_kw):
                if ch.token_ids and r.ttft_ms is None:
                    r.ttft_ms = (time.perf_counter() - t0) * 1e3
                r.tokens.extend(ch.token_ids)
                if ch.finished:
                    r.acceptance_lengths = list(ch.stats["acceptance_lengths"])
                    r.prefill_ms = ch.stats.get("prefill_ms")
                    r.service_ttft_ms = ch.stats.get("ttft_ms")
            r.latency_ms = (time.perf_counter() - t0) * 1e3
        except GenerationError as e:
            r.error = str(e)

    return open_client, one


def run_clients(client, concurrency: int, results: list[RequestResult], timeout_s: float,
                name: str) -> tuple[list[RequestResult], float]:
    """Run `concurrency` threads of `client` (each takes prompts until none is left) under one bound; a result
    not finished by then is marked so. Returns the results and the wall time in seconds."""
    threads = [threading.Thread(target=client, daemon=True, name=f"{name}-{k}") for k in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s * (len(results) // max(concurrency, 1) + 1) + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    wall = time.perf_counter() - t0
    for r in results:
        if r.latency_ms is None and r.error is None:
            r.error = "not finished when the run's bound passed"
    return results, wall


def centiles(s: list[float]) -> list[float]:
    """The 99 cut points of sorted, non-empty s (inclusive linear interpolation), never decreasing and never past
    s's last value: statistics.quantiles rounds an interpolation between two equal values a unit in the last
    place below them, so a p99 came out under its p90."""
    q = statistics.quantiles(s, n=100, method="inclusive") if len(s) > 1 else [s[0]] * 99
    out, top = [], s[0]
    for v in q:
        top = min(max(top, v), s[-1])
        out.append(top)
    return out


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p95": None, "mean": None, "n": 0}
    s = sorted(xs)
    q = centiles(s)
    return {"p50": q[49], "p95": q[94], "mean": statistics.fmean(s), "n": len(s)}


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    steps = [a for r in ok for a in r.acceptance_lengths]
    out_tokens = sum(len(r.tokens) for r in ok)
    return {"requests": len(results), "errors": len(results) - len(ok),
            "first_errors": [r.error for r in results if r.error][:3],
            "ttft_ms": percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
            "latency_ms": percentiles([r.latency_ms for r in ok]),
            "prefill_ms": percentiles([r.prefill_ms for r in ok if r.prefill_ms is not None]),
            "service_ttft_ms": percentiles([r.service_ttft_ms for r in ok if r.service_ttft_ms is not None]),
            "output_tokens": out_tokens, "wall_s": wall_s,
            "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
            "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
            "tau": sum(steps) / len(steps) if steps else None}

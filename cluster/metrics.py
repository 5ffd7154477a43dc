"""Prometheus metrics of the router and the workers (prometheus_client), one registry per process.

Per request (observed when it ends): TTFT and latency histograms, tau, accepted draft tokens per
draft position, output tokens, outcome. Live values (read from their owner at scrape time, so
nothing is counted twice): queue depth, running requests, free KV blocks, preemptions, prefix-cache
hits and misses by tier, bridge bytes, seconds and GB/s, recompute fallbacks, worker restarts.

The per-request counters and histograms are kept in this process's memory (`_Family`), not in prometheus_client's
Counter and Histogram: with PROMETHEUS_MULTIPROC_DIR in a process's environment those keep every value in a file of
that directory named by the process id (made for a MultiProcessCollector, which nothing here uses), and start from
what the file holds. A process that got a dead one's pid then counted on from the dead one's totals: LMCache sets
the variable for good in any process that builds its engine, the processes started from there inherit it, and a
Ray prefill worker reported 68 prefills for the 32 it ran (a CI failure).
"""
from __future__ import annotations

import bisect
import logging
import math
import threading
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TAU = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0)

LiveFn = Callable[[], dict[tuple[str, ...], float]]


class _Live:
    """A collector of metric families whose values come from callables at scrape time."""

    def __init__(self) -> None:
        self.families: list[tuple[str, str, str, tuple[str, ...], LiveFn]] = []
        self.scrapes = 0  # scrapes begun (Metrics.per_scrape)
        self._failing: tuple[str, ...] = ()  # the last scrape's failures (their messages), logged when they change

    def collect(self) -> Iterable:
        self.scrapes += 1
        failed: dict[str, list[str]] = {}
        first: Exception | None = None
        for name, doc, kind, labels, fn in self.families:
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=list(labels))
            try:
                values = fn()
            except Exception as e:  # noqa: BLE001  a failing source leaves its family empty, and says so
                failed.setdefault(f"{type(e).__name__}: {e}", []).append(name)
                first = first or e
                values = {}
            for key, v in values.items():
                fam.add_metric(list(key), float(v))
            yield fam
        self._note(failed, first)

    def _note(self, failed: dict[str, list[str]], first: Exception | None) -> None:
        """Log the scrape's failures once while they stay the same (a stuck engine process fails every live family
        of every scrape: a traceback each buried the log), and their end once."""
        now = tuple(sorted(failed))
        last, self._failing = self._failing, now
        if now and now != last:
            log.error("metrics could not be read, left empty until they can: %s",
                      "; ".join(f"{', '.join(names)} ({why})" for why, names in sorted(failed.items())),
                      exc_info=(type(first), first, first.__traceback__) if first is not None else None)
        elif not now and last:
            log.warning("metrics can be read again")


class _Family:
    """A counter (buckets None) or a histogram (its upper bounds) by label values, in this process's memory (see the
    module's docstring); collected like prometheus_client's (a counter's `_total`, a histogram's `_bucket`, `_count`
    and `_sum`)."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...] | None = None) -> None:
        self.name, self.doc, self.labelnames = name, doc, labels
        self.bounds = None if buckets is None else tuple(sorted(buckets)) + (math.inf,)
        self._children: dict[tuple[str, ...], _Child] = {}
        self.lock = threading.Lock()

    def labels(self, *values: object) -> "_Child":
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, got {key}")
        with self.lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = _Child(self)
            return child

    def collect(self) -> Iterable:
        with self.lock:
            rows = [(k, c.value, list(c.counts)) for k, c in self._children.items()]
        if self.bounds is None:
            fam = CounterMetricFamily(self.name, self.doc, labels=list(self.labelnames))
            for key, value, _ in rows:
                fam.add_metric(list(key), value)
            yield fam
            return
        fam = HistogramMetricFamily(self.name, self.doc, labels=list(self.labelnames))
        for key, total, counts in rows:
            cumulative, buckets = 0.0, []
            for bound, n in zip(self.bounds, counts):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            fam.add_metric(list(key), buckets, total)
        yield fam


class _Child:
    """One label set's value: a counter's total, or a histogram's sum (`value`) and per-bucket counts."""

    __slots__ = ("_family", "value", "counts")

    def __init__(self, family: _Family) -> None:
        self._family = family
        self.value = 0.0
        self.counts = [0] * len(family.bounds) if family.bounds is not None else []

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"{self._family.name}: a counter only goes up, got {amount}")
        with self._family.lock:
            self.value += amount

    def observe(self, amount: float) -> None:
        i = bisect.bisect_left(self._family.bounds, amount)  # the first bucket whose bound is >= amount
        with self._family.lock:
            self.value += amount
            self.counts[i] += 1  # the last bound is +Inf


class Metrics:
    """The metrics of one process; `role` (router, prefill, decode, bridge, colocated) is a label."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = _Family("flashpd_ttft_seconds", "Time to first token", ("role", "method"), SECONDS)
        self.latency = _Family("flashpd_latency_seconds", "Whole-request latency", ("role", "method"), SECONDS)
        self.tau = _Family("flashpd_tau", "Mean acceptance length of a DFlash request", ("role",), TAU)
        self.accepted = _Family("flashpd_accepted_tokens", "Draft tokens accepted, by draft position (1 = first)",
                                ("role", "position"))
        self.requests = _Family("flashpd_requests", "Requests ended, by method and outcome",
                                ("role", "method", "outcome"))
        self.output_tokens = _Family("flashpd_output_tokens", "Tokens generated", ("role", "method"))
        for fam in (self.ttft, self.latency, self.tau, self.accepted, self.requests, self.output_tokens):
            r.register(fam)
        self._live = _Live()
        r.register(self._live)

    def live(self, name: str, doc: str, kind: str, labels: tuple[str, ...], fn: LiveFn) -> None:
        """Add a family read from fn() at scrape time: {label values: value}; the role label is added."""
        self._live.families.append((name, doc, kind, ("role",) + labels,
                                    lambda: {(self.role,) + k: v for k, v in fn().items()}))

    def per_scrape(self, fn: Callable[[], dict]) -> Callable[[], dict]:
        """fn() read once per scrape, its result (or its failure) shared by the scrape's live families: with the
        engine in its own process each read is a round trip, and a stuck engine made each family wait out its own
        timeout (5 s each, 45 s a scrape). A scrape reads afresh, so no family shows an earlier scrape's value."""
        lock = threading.Lock()
        memo: list = [-1, None, None]  # the scrape read in, the value, the failure

        def read() -> dict:
            with lock:  # a second read of this scrape waits for the first and takes its result
                n = self._live.scrapes
                if memo[0] != n:
                    try:
                        memo[:] = [n, fn(), None]
                    except Exception as e:  # noqa: BLE001  shared: every family of this scrape fails at once
                        memo[:] = [n, None, e]
                if memo[2] is not None:
                    raise memo[2]
                return memo[1]
        return read

    def observe_request(self, method: str, stats: dict, outcome: str, output_tokens: int) -> None:
        """One finished request: stats as RequestStats.as_dict() / the API's stats (ms, acceptance_lengths)."""
        self.requests.labels(self.role, method, outcome).inc()
        self.output_tokens.labels(self.role, method).inc(output_tokens)
        if outcome != "ok":
            return
        if stats.get("ttft_ms") is not None:
            self.ttft.labels(self.role, method).observe(stats["ttft_ms"] / 1e3)
        if stats.get("latency_ms") is not None:
            self.latency.labels(self.role, method).observe(stats["latency_ms"] / 1e3)
        lens = stats.get("acceptance_lengths") or []
        if lens:
            self.tau.labels(self.role).observe(sum(lens) / len(lens))
            for n in lens:  # a step that commits n tokens accepted its drafts at positions 1..n-1
                for k in range(1, n):
                    self.accepted.labels(self.role, str(k)).inc()

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP on host:port (0 = a free port); returns the port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        if getattr(self, "_http", None) is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def exposition(self) -> str:
        from prometheus_client import generate_latest  # noqa: PLC0415

        return generate_latest(self.registry).decode()

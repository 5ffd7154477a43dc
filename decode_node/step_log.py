"""The engine loop's periodic log line: what it did since the last line, so that a slow stretch of serving can be
read from the worker's log afterwards (a load sweep's levels by their timestamps) without a profiler.

Each line: steps, their mean wall time and the seconds spent stepping (time idle between requests is left out: the
interval over the steps read a step hundreds of times slower than it was for a few requests with pauses), tokens
streamed and their rate, requests admitted, device-loop sessions ended (each one a wait for the step in flight and a
new session for every row), and the batch's running and waiting counts at the end. Nothing is logged for an
interval without steps.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class StepLog:
    """Called after each engine step (EngineLoop's after_step); writes one INFO line per `interval_s` at most."""

    def __init__(self, loop, interval_s: float = 10.0) -> None:
        self.loop = loop
        self.interval_s = interval_s
        self._last = self._reading()

    def _reading(self) -> tuple[float, int, int, int, int, float]:
        s = self.loop.scheduler
        return time.monotonic(), self.loop.steps, self.loop.tokens_out, s.admitted, s.sessions_ended, self.loop.step_s

    def __call__(self) -> None:
        if time.monotonic() - self._last[0] < self.interval_s:
            return
        cur = self._reading()
        t, steps, tokens, admitted, ended, busy = (b - a for a, b in zip(self._last, cur))
        self._last = cur
        if steps <= 0:
            return
        s = self.loop.scheduler
        log.info("engine: %d steps in %.1f s (%.2f ms a step, stepping %.1f s), %d tokens (%.0f/s), %d admitted, "
                 "%d device-loop sessions ended, running %d, waiting %d", steps, t, busy * 1e3 / steps, busy, tokens,
                 tokens / t, admitted, ended, len(s.running), len(s.waiting))

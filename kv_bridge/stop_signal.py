"""A stop asked for by SIGINT or SIGTERM, recorded without a lock.

A signal handler runs on the main thread between two of its bytecodes. `threading.Event.set` in a handler takes the
Event's lock, which the main thread may hold at that moment inside its own `Event.wait` (entering or leaving the
condition): a second SIGTERM arriving inside the first handler left a bridge worker waiting on its own lock for good,
an orphan once its launcher had gone. The handler here sets a flag; the main thread naps and looks."""
from __future__ import annotations

import signal
import time

NAP_S = 0.1  # how soon a stop is seen


class StopSignal:
    """Installs handlers for `signals` (from the main thread) that record a stop; `wait` says whether one came."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.requested = False
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, _signum: int, _frame: object) -> None:
        self.requested = True  # a plain store: no lock for a second signal to wait on

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once a stop was asked for; else naps up to timeout_s (None: until one comes) and says whether one
        came meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.requested:
            left = NAP_S if deadline is None else min(NAP_S, deadline - time.monotonic())
            if left <= 0:
                break
            time.sleep(left)
        return self.requested

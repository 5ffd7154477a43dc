"""A request handle with no engine behind it, for front-end tests: events are put on its queue by the test."""
from __future__ import annotations

import queue


class FakeHandle:
    """What a Backend's submit returns (decode_node/engine_loop.Handle's get): events in order, None on a timeout."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()

    def get(self, timeout: float):
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

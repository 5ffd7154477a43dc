"""A Counter that widens the windows in which unlocked use of a counter shared by threads goes wrong."""
from __future__ import annotations

import time
from collections import Counter

PAUSE_S = 0.0005


class SlowCounter(Counter):
    """Gives the interpreter up between reading a count and the caller writing it back (`c[k] += 1` is two steps),
    and between the items and values it yields (a thread adding a key then fails the read: "dictionary changed size
    during iteration"); wide enough that each goes wrong every time, unlocked."""

    def __getitem__(self, k):
        v = super().__getitem__(k)
        time.sleep(PAUSE_S)
        return v

    def items(self):
        for kv in super().items():
            time.sleep(PAUSE_S)
            yield kv

    def values(self):
        for v in super().values():
            time.sleep(PAUSE_S)
            yield v

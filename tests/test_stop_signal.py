"""kv_bridge.stop_signal: the stop a worker, the bridge and `flashpd serve` wait on. Its handler takes no lock: a
threading.Event set from a handler could wait on the lock the main thread held in Event.wait, and a second SIGTERM
inside the first handler left a worker stuck for good (an orphan once its launcher had gone)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_CHILD = r"""
import sys, time
from flashpd.kv_bridge.stop_signal import StopSignal
done = StopSignal()
print("ready", flush=True)
while not done.wait(1.0):
    pass
print("stopped", flush=True)
"""


def test_a_burst_of_signals_stops_the_waiter_promptly():
    """200 SIGTERMs and SIGINTs as fast as they can be sent, many landing inside the handler of another: the
    process stops, says so, and exits 0 within seconds, every time of 5."""
    for _ in range(5):
        p = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            t0 = time.monotonic()
            for i in range(200):
                try:
                    os.kill(p.pid, signal.SIGTERM if i % 2 else signal.SIGINT)
                except ProcessLookupError:  # it has exited already
                    break
            out, _ = p.communicate(timeout=20)
            assert p.returncode == 0 and out.strip() == "stopped", (p.returncode, out)
            assert time.monotonic() - t0 < 15
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_wait_returns_at_its_timeout_or_at_once_once_asked():
    from flashpd.kv_bridge.stop_signal import StopSignal

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        done = StopSignal()
        t0 = time.monotonic()
        assert done.wait(0.3) is False and 0.25 < time.monotonic() - t0 < 10
        os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.monotonic()
        assert done.wait(30) is True and time.monotonic() - t0 < 10
        assert done.wait(None) is True
    finally:
        for s, h in old.items():
            signal.signal(s, h)

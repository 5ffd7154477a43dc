"""`flashpd serve` as a child process for CLI tests: start it, read the address (and metrics endpoint) it
prints, stop it. Every wait is bounded. Not a test module."""
from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Iterator


@contextlib.contextmanager
def serve_process(args: list[str], start_timeout_s: float = 60.0) -> Iterator[tuple[str, str | None]]:
    """Yields (address, metrics address or None) of `python -m flashpd.cli serve ARGS`; on exit the process
    is terminated and must have exited cleanly."""
    proc = subprocess.Popen([sys.executable, "-m", "flashpd.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    try:
        address, metrics, seen = None, None, []
        deadline = time.monotonic() + start_timeout_s
        while address is None and time.monotonic() < deadline:
            try:
                ln = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
                continue
            seen.append(ln)
            if ln.startswith("metrics on "):
                metrics = ln.split()[-1]
            if ln.startswith("listening on "):
                address = ln.split()[-1]
        assert address, f"server did not start: {''.join(seen)}"
        yield address, metrics
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0

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
def serve_lines(args: list[str], start_timeout_s: float = 60.0) -> Iterator[dict[str, str]]:
    """Yields what `python -m flashpd.cli serve ARGS` printed before it listened, as {"listening": HOST:PORT,
    "metrics": ..., "http": ...} (each "X on ADDR" line it printed); on exit the process is terminated and must
    have exited cleanly."""
    proc = subprocess.Popen([sys.executable, "-m", "flashpd.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    try:
        found, seen = {}, []
        deadline = time.monotonic() + start_timeout_s
        while "listening" not in found and time.monotonic() < deadline:
            try:
                ln = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
                continue
            seen.append(ln)
            for key in ("metrics", "http", "listening"):
                if ln.startswith(f"{key} on "):
                    found[key] = ln.split()[-1]
        assert "listening" in found, f"server did not start: {''.join(seen)}"
        yield found
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0


@contextlib.contextmanager
def serve_process(args: list[str], start_timeout_s: float = 60.0) -> Iterator[tuple[str, str | None]]:
    """Yields (address, metrics address or None) of `python -m flashpd.cli serve ARGS` (see serve_lines)."""
    with serve_lines(args, start_timeout_s) as found:
        yield found["listening"], found.get("metrics")

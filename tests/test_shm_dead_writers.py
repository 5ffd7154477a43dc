"""Segments nobody can take any more: a writer's (the pid in the name) that is gone. A bridge killed after writing
its Get segments, or a client killed mid-Put with segments written ahead of the frames the bridge read, left them
in /dev/shm until a later start found them 600 s old. Real processes write real segments here."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from flashpd.kv_bridge import shm
from flashpd.kv_bridge.server import serve
from flashpd.kv_bridge.store import MemoryStore

pytestmark = pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="needs /dev/shm")

_WRITE = ("import sys; from flashpd.kv_bridge import shm; "
          "print(shm.write_segment(b'g' * 64, shm.GET_TAG), shm.write_segment(b'p' * 64, 'put-' + 'a' * 32 + '-'),"
          " flush=True); sys.stdin.read()")


def _writer() -> tuple[subprocess.Popen, list[str]]:
    """A process that writes a Get-like and a Put-like segment, then waits for its stdin to close."""
    p = subprocess.Popen([sys.executable, "-c", _WRITE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    names = p.stdout.readline().split()
    assert len(names) == 2 and all(n.startswith(f"{shm.PREFIX}{p.pid}-") for n in names)
    return p, names


def _age(names: list[str], s: float) -> None:
    t = time.time() - s
    for n in names:
        os.utime(shm.SHM_DIR / n, (t, t))


def _present(names: list[str]) -> list[bool]:
    return [(shm.SHM_DIR / n).exists() for n in names]


def test_the_segments_of_a_dead_writer_go_after_the_grace_and_a_live_ones_stay():
    live, live_names = _writer()
    dead, dead_names = _writer()
    try:
        dead.stdin.close()
        dead.wait(30)
        _age(live_names, 120)
        assert shm.sweep_dead_writers(grace_s=30) == 0  # the dead writer's are fresh; the live one's are its own
        assert _present(dead_names) == [True, True] and _present(live_names) == [True, True]
        _age(dead_names, 31)
        assert shm.sweep_dead_writers(grace_s=30) == 2
        assert _present(dead_names) == [False, False] and _present(live_names) == [True, True]
    finally:
        live.stdin.close()
        live.wait(30)
        for n in live_names + dead_names:
            shm.unlink_segment(n)


def test_a_starting_bridge_sweeps_them():
    dead, names = _writer()
    dead.stdin.close()
    dead.wait(30)
    _age(names, 60)  # past the grace, far under the start's age sweep (SHM_SWEEP_AGE_S)
    server, port = serve(MemoryStore(1 << 20))
    try:
        assert _present(names) == [False, False]
    finally:
        server.stop(None).wait(10)
        for n in names:
            shm.unlink_segment(n)


def test_a_sweep_counts_only_the_segments_it_removed(monkeypatch):
    """Two paths expire a server's Get segments (its TTL sweep and a waiting Get's ledger), and the stats add
    both: a segment the other path unlinked between this sweep's look at it and its own unlink is not counted
    again (it was: shm_segments_expired read 2 for one segment)."""
    name = shm.write_segment(b"g" * 64, shm.GET_TAG)
    _age([name], 120)
    real = os.unlink

    def taken_first(path, *a, **kw):  # the other path wins the race: the file is gone when this unlink runs
        real(path, *a, **kw)
        raise FileNotFoundError(path)

    monkeypatch.setattr(shm.os, "unlink", taken_first)
    try:
        assert shm.sweep_segments(60, os.getpid(), shm.GET_TAG) == 0
        assert not (shm.SHM_DIR / name).exists()
    finally:
        monkeypatch.undo()
        shm.unlink_segment(name)

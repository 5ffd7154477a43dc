"""A worker's stop and its counters, with real worker processes, real gRPC on 127.0.0.1 and the fixture pair.

A decode worker stopped while its engine loop, or a load thread the loop started, is still at work keeps its bridge
client open until they are done (bounded), as a prefill worker does for its running prefill: it closed the client
first, the work then made its first Lookup on the closed channel, and the process died of a segmentation fault. A
decode worker's counters that other threads add reasons to are read by a scrape (stats(), the per-reason family)
without failing on "dictionary changed size during iteration". A worker stopped or killed by the local launcher
takes the processes it started with it (its process group; they used to outlive it)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from flashpd.cluster import local_launcher, worker_main
from flashpd.cluster.launcher import WorkerSpec
from flashpd.cluster.local_launcher import LocalLauncher
from flashpd.cluster.metrics import Metrics
from flashpd.decode_node.handoff_import import HandoffImport
from flashpd.decode_node.worker import DecodeWorker
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.store import MemoryStore

from tests._cluster_helpers import dflash_pair, serve_cfg  # noqa: F401
from tests._counters import SlowCounter

# ---- 1. a decode worker stopped while its work goes on keeps its bridge client open -----------------------------
# The decode worker's first request is held (the test's gate) on the engine loop's thread (where="engine_loop": as it
# is taken; the loop then does not stop within LOOP_STOP_S) or on a load thread (where="load_thread": the fetch of
# its prefix; the loop itself stops at once). The worker is stopped; then the gate opens and the request's fetch
# makes the bridge client's first Lookup (the bridge, 127.0.0.1:1, refuses it: counted, recomputed). On a closed
# channel a first call crashes the process.
_STOP_WHILE_AT_WORK = r"""
import json, sys, threading, time
from concurrent.futures import wait
from flashpd.cluster import worker_main
from flashpd.cluster.config import ServeConfig
from flashpd.cluster.generation_client import build_request
from flashpd.cluster.generation_server import PROTOCOL_VERSION
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.worker_client import WorkerClient
from flashpd.decode_node.scheduler import Scheduler
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.prefix_cache import PrefixCache

where = sys.argv[2]
worker_main.LOOP_STOP_S = worker_main.QUIESCE_S = 1.0  # (old code: no LOOP_STOP_S, its loop waited a fixed 10 s)
gate, held = threading.Event(), threading.Event()
stopped = threading.Event()

def hold():
    if not gate.is_set():
        held.set()
        gate.wait(60)

real_add, real_fetch = Scheduler.add, PrefixCache.fetch

def add(self, *a, **kw):  # the engine loop's thread, taking the request
    if where != "engine_loop":
        return real_add(self, *a, **kw)
    hold()
    req = real_add(self, *a, **kw)
    wait([req.load], 30)  # its fetch has run before the loop goes on (its step would wait for it too)
    return req

def fetch(self, gen, prompt):  # a load thread
    if where == "load_thread":
        hold()
    try:
        return real_fetch(self, gen, prompt)
    except BaseException as e:
        if stopped.is_set():
            print("bridge called after the stop:", type(e).__name__, flush=True)
        raise

Scheduler.add, PrefixCache.fetch = add, fetch
cfg = ServeConfig.from_dict(json.loads(sys.argv[1]), "test")
secret = ClusterSecret.generate()
w = worker_main.build_worker("decode", cfg, 0, secret)
client = WorkerClient("decode", w.address, secret.worker_token)

def decode():
    try:
        req = pb.DecodeRequest(version=PROTOCOL_VERSION, request=build_request(list(range(1, 80)), max_tokens=2,
                                                                              method="native", ignore_eos=True))
        list(client.decode(req, 60.0))
    except Exception:
        pass  # its call ends with the stop; the held work goes on

threading.Thread(target=decode, daemon=True).start()
assert held.wait(60), "the request was never held"
w.stop()
stopped.set()
gate.set()
time.sleep(3.0)  # the held work goes on: the fetch calls the bridge
print("survived", flush=True)
"""


@pytest.mark.parametrize("where", ["engine_loop", "load_thread"])
def test_a_decode_worker_stopped_while_its_work_goes_on_does_not_crash(dflash_pair, where):  # noqa: F811
    cfg = serve_cfg(dflash_pair, "local", bridge_address="127.0.0.1:1", worker_metrics=False)
    r = subprocess.run([sys.executable, "-c", _STOP_WHILE_AT_WORK, json.dumps(cfg.to_dict()), where],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stdout[-500:], r.stderr[-1500:])
    assert "bridge called after the stop: BridgeUnavailable" in r.stdout  # the work did reach the (open) client
    assert "bridge client is left open" in r.stderr


# ---- 2. counters other threads add reasons to, read by a scrape ------------------------------------------------


def test_a_decode_workers_counters_read_while_the_engine_adds_reasons(dflash_pair):  # noqa: F811
    """stats() (every decode family of a scrape reads it) and the per-reason family, read all the while another
    thread adds import failures, publish failures and device-path fallbacks under new reasons."""
    target = load_target(dflash_pair.target_dir)
    cache = PrefixCache(MemoryStore(1 << 20, ClusterSecret.generate()), "fp", 32)
    worker = DecodeWorker(ModelRunner(target, 64, 16), prefix_cache=cache, step_log_s=0)
    try:
        metrics = Metrics("decode")
        worker_main.decode_metrics(metrics, worker)
        reasons = {name: fn for name, *_, fn in metrics._live.families}["flashpd_recompute_fallbacks"]
        seen = {f"seen_{i}": 1 for i in range(20)}
        worker.cache.import_failures = SlowCounter(seen)
        worker.cache.publish_failures = SlowCounter(seen)
        worker.scheduler.handoff = HandoffImport(None, lambda h: None)  # type: ignore[arg-type]
        worker.scheduler.handoff.fallbacks = SlowCounter(seen)
        stop = threading.Event()

        def add() -> None:  # what the engine, load and save threads do on a failure
            for i in range(60):
                if stop.is_set():
                    return
                worker.cache.import_failures[f"new_{i}"] += 1
                worker.cache.publish_failures[f"new_{i}"] += 1
                worker.scheduler.handoff.fallback(f"reason {chr(ord('a') + i % 26)}{i // 26}")
                time.sleep(0.001)

        t = threading.Thread(target=add)
        t.start()
        failures, reads = [], 0
        try:
            while t.is_alive() or reads == 0:
                reads += 1
                try:
                    st = worker.stats()
                    assert st["import_failures"] >= 20 and st["handoff_fallbacks"] >= 20, st
                    assert len(reasons()) >= 20
                except RuntimeError as e:
                    failures.append(e)
        finally:
            stop.set()
            t.join(30)
        assert not failures, f"{len(failures)} of {reads} reads failed: {failures[0]}"
        st = worker.stats()  # every count is there once the adds are done
        assert st["import_failures"] == st["publish_failures"] == 80 and st["handoff_fallbacks"] == 80, st
        assert len(reasons()) == 80
    finally:
        worker.stop()


# ---- 3. what a worker started goes with it ----------------------------------------------------------------------
# A library in the worker starts a process of its own (here: sitecustomize, in a bridge worker the launcher starts
# as it starts any worker); it writes that process's pid where the test reads it.
_SPAWNS_A_CHILD = """\
import os, subprocess, sys
path = os.environ.pop("TEST_GRANDCHILD_PID_FILE", None)
if path:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(path, "w") as f:
        f.write(str(p.pid))
"""


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE  # killed (whoever adopted it reaps it, or not)
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("how", ["kill", "stop", "shutdown", "died"])
def test_what_a_worker_started_goes_with_it(dflash_pair, tmp_path, monkeypatch, how):  # noqa: F811
    """kill (SIGKILL: a crash, or a worker that would not stop), stop (SIGTERM: the worker exits, what it started
    does not, here), shutdown, and a worker SIGKILLed from outside alone (the OOM killer), seen dead by alive() (which
    reaps it) and then stopped, as the pool's restart does: the worker's grandchild is gone with it."""
    (tmp_path / "sitecustomize.py").write_text(_SPAWNS_A_CHILD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TEST_GRANDCHILD_PID_FILE", str(tmp_path / "grandchild.pid"))
    launcher = LocalLauncher(tmp_path / "logs")
    grandchild = None
    try:
        (w,) = launcher.start([WorkerSpec("bridge", 0, serve_cfg(dflash_pair, "local"))], 60.0)
        grandchild = psutil.Process(int((tmp_path / "grandchild.pid").read_text()))
        assert os.getpgid(grandchild.pid) == w.handle.proc.pid  # in the worker's group, as a library's child is
        if how == "kill":
            launcher.kill(w)
            assert w.handle.proc not in launcher.processes()  # stopped: no longer the launcher's
        elif how == "stop":
            launcher.stop(w, 10.0)
            assert w.handle.proc.returncode == 0  # it stopped by itself, on SIGTERM
        elif how == "shutdown":
            launcher.shutdown()
        else:
            os.kill(w.handle.proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while launcher.alive(w, 1.0) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert w.handle.proc.returncode == -signal.SIGKILL and not _gone(grandchild)
            launcher.stop(w, 10.0)
        deadline = time.monotonic() + 10
        while not _gone(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(grandchild), f"the worker's child (pid {grandchild.pid}) outlived it ({how})"
    finally:
        launcher.shutdown()
        if grandchild is not None and not _gone(grandchild):
            grandchild.kill()


# A worker whose SIGTERM handler takes a while to install (here: made slow on purpose, as a loaded machine may be).
_SLOW_SIGTERM_HANDLER = """\
import signal, time
_install = signal.signal
def _slow(sig, handler):
    if sig == signal.SIGTERM:
        time.sleep(1.0)
    return _install(sig, handler)
signal.signal = _slow
"""


def test_a_worker_stopped_the_moment_it_serves_stops_cleanly(dflash_pair, tmp_path, monkeypatch):  # noqa: F811
    """The launcher may send SIGTERM as soon as it reads `listening on`: the worker's handler is in place by then, so
    it stops by itself (exit 0), not by the signal's default action (-15, its clean-up skipped)."""
    (tmp_path / "sitecustomize.py").write_text(_SLOW_SIGTERM_HANDLER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    launcher = LocalLauncher(tmp_path / "logs")
    try:
        (w,) = launcher.start([WorkerSpec("bridge", 0, serve_cfg(dflash_pair, "local"))], 60.0)
        launcher.stop(w, 10.0)
        assert w.handle.proc.returncode == 0
    finally:
        launcher.shutdown()


def test_the_launcher_never_signals_its_own_process_group(monkeypatch):
    """A child that is not the leader of a group of its own (its pid is this process's group's id: never so for a
    child started with start_new_session, but never to be relied on) is signalled alone."""
    groups: list[tuple[int, int]] = []
    sent: list[int] = []
    monkeypatch.setattr(local_launcher.os, "killpg", lambda g, s: groups.append((g, s)))

    class _Proc:
        pid = os.getpgrp()
        returncode = None

        def send_signal(self, sig: int) -> None:
            sent.append(sig)

    assert local_launcher._signal_group(_Proc(), signal.SIGKILL)
    assert groups == [] and sent == [signal.SIGKILL]


def test_a_reaped_worker_leaves_nothing_to_signal(tmp_path):
    """A worker that exited by itself and was reaped (a liveness check's poll()), with nothing left in its group:
    its stop signals nothing (ESRCH), and says so."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait(30)
    assert local_launcher._signal_group(proc, signal.SIGKILL) is False


def test_a_worker_already_stopped_by_the_launcher_is_not_signalled_twice(tmp_path):
    """stop() on a worker stop() already ended (a restart, then shutdown): nothing is signalled, nothing raises."""
    L = LocalLauncher(tmp_path / "logs")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    c = local_launcher._Child(WorkerSpec("bridge", 0, None), proc, Path(tmp_path / "none.log"))
    L._children.append(c)
    L._kill(c, 5.0)
    assert proc.returncode == -signal.SIGTERM and L.processes() == []
    L._kill(c, 5.0)  # again: already reaped
    L.shutdown()

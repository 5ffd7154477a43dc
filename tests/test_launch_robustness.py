"""The local launcher's start and its children, with real worker processes on 127.0.0.1 over the fixture pair: a
worker that exits while another still starts fails the start at once, by its own name (it used to be noticed only
once the ones before it were ready, or named as one of those that "did not start in time"); a spawn refused by the
system stops the workers already spawned (they went on loading, then served nobody); a byte on a worker's stdout
that is no UTF-8 neither stops the reader of its output nor leaves the worker blocked on a full pipe; what a worker
prints after `listening on` is drained and not kept. A worker that hangs (a prefill, or a decode worker's engine
step, that never returns: here the config's fault delay, and a step held on an event) says it is not serving once
past its stall bound (the config's stall_s, 1 s here), so the pool restarts it (it said serving for good), and
serving again once it moves. A prefill worker stopped while a prefill runs lets it end before its bridge client
closes (the prefill then called the closed channel, and the process died of a segmentation fault). A worker whose
launcher is killed while one of its prefills hangs still exits (its interpreter's exit waited for that prefill's
thread for good)."""
from __future__ import annotations

import errno
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
from flashpd.cluster.generation_client import build_request
from flashpd.cluster.generation_server import PROTOCOL_VERSION
from flashpd.cluster.launcher import Launched, WorkerSpec, WorkerStartError
from flashpd.cluster.local_launcher import LocalLauncher, _Child
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.worker_client import WorkerClient
from flashpd.decode_node.scheduler import Scheduler
from flashpd.kv_bridge.auth import ClusterSecret

from tests._cluster_helpers import dflash_pair, serve_cfg, wait_until  # noqa: F401


def _workers_of_this_process() -> list[psutil.Process]:
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if "flashpd.cluster.worker_main" in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE:
                out.append(c)
        except psutil.Error:  # gone meanwhile
            pass
    return out


@pytest.fixture
def launcher():
    L = LocalLauncher()
    before = {p.pid for p in _workers_of_this_process()}
    yield L
    L.shutdown()
    for p in _workers_of_this_process():  # an old-code start left one behind: freed, so nothing outlives the test
        if p.pid not in before:
            p.kill()


def test_a_worker_exiting_while_another_starts_fails_the_start_at_once_by_name(dflash_pair, launcher):  # noqa: F811
    """The prefill worker is SIGSTOPped as it starts (a GPU worker warming up for minutes looks the same); the decode
    worker beside it has no checkpoint and exits at once. The start used to wait for the prefill worker first: its
    whole timeout here, and then it blamed the prefill worker."""
    good = serve_cfg(dflash_pair, "local", bridge_address="127.0.0.1:1")
    bad = good.with_(target=str(Path(dflash_pair.target_dir).parent / "no-such-checkpoint"))
    out: dict = {}

    def start() -> None:
        t0 = time.monotonic()
        try:
            launcher.start([WorkerSpec("prefill", 0, good), WorkerSpec("decode", 0, bad)], 90.0)
        except WorkerStartError as e:
            out["error"] = str(e)
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=start, daemon=True)
    t.start()
    wait_until(lambda: len(launcher._children) == 2, "both workers to be spawned", every_s=0.005)
    os.kill(launcher._children[0].proc.pid, signal.SIGSTOP)
    t.join(120)
    assert not t.is_alive()
    assert out.get("error", "").startswith("decode worker 0 exited with 2 while starting"), out
    assert "no-such-checkpoint" in out["error"]  # its log's tail: the cause
    assert out["s"] < 60, f"the failure was reported only after {out['s']:.0f} s"
    assert launcher.processes() == [] and not _workers_of_this_process()  # the stopped prefill worker too


def test_a_spawn_that_fails_stops_the_workers_already_spawned(dflash_pair, launcher, monkeypatch):  # noqa: F811
    """The second fork is refused (EAGAIN: a pid or memory limit): the bridge already spawned must not go on."""
    real = subprocess.Popen
    spawned: list[subprocess.Popen] = []

    def popen(*a, **kw):
        if spawned:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        spawned.append(real(*a, **kw))
        return spawned[-1]

    monkeypatch.setattr(local_launcher.subprocess, "Popen", popen)
    cfg = serve_cfg(dflash_pair, "local")
    with pytest.raises(WorkerStartError, match=r"bridge worker 1 could not be spawned: BlockingIOError"):
        launcher.start([WorkerSpec("bridge", 0, cfg), WorkerSpec("bridge", 1, cfg)], 60.0)
    assert len(spawned) == 1
    assert spawned[0].poll() is not None, "the worker spawned before the refused one still runs"
    assert launcher.processes() == []


def test_a_worker_printing_bytes_not_utf8_still_starts(dflash_pair, launcher, tmp_path, monkeypatch):  # noqa: F811
    """A library in the worker writes a byte that is no UTF-8, then more than a pipe holds, to its stdout (a native
    library's print). The reader of its output died on that byte: the start then waited out its timeout, and the
    worker, its pipe full and no longer read, blocked for good."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nos.write(1, b'\\xff\\xfe not utf-8\\n' + b'x' * 200_000 + b'\\n')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    (w,) = launcher.start([WorkerSpec("bridge", 0, serve_cfg(dflash_pair, "local"))], 40.0)
    assert launcher.alive(w, 1.0) and w.address.startswith("127.0.0.1:")
    assert time.monotonic() - t0 < 30


def test_what_a_worker_prints_after_listening_is_drained_not_kept(tmp_path):
    """Nobody reads a child's lines once it listens: kept, they grew for its whole life."""
    code = ("import sys\nprint('metrics on 127.0.0.1:2')\nprint('listening on 127.0.0.1:1', flush=True)\n"
            "for i in range(20000):\n    print('noise', i)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, errors="replace")
    c = _Child(WorkerSpec("bridge", 0, None), proc, tmp_path / "none.log")
    assert proc.wait(30) == 0  # it was drained to its end
    lines = []
    deadline = time.monotonic() + 10
    while (not lines or lines[-1] is not None) and time.monotonic() < deadline:
        lines.append(c.lines.get(timeout=10))
    assert lines == ["metrics on 127.0.0.1:2", "listening on 127.0.0.1:1", None]


# ---- hung workers: their Health says so -------------------------------------------------------------------------
HANG_S = 12.0  # how long the injected hang lasts; the stall bound is 1 s, so Health must turn well before it ends


def _serving(client: WorkerClient) -> bool:
    return client.health(10.0)["serving"]


def test_a_prefill_worker_hung_in_a_prefill_says_not_serving_until_it_ends(dflash_pair):  # noqa: F811
    secret = ClusterSecret.generate()
    cfg = serve_cfg(dflash_pair, "local", bridge_address="127.0.0.1:1", fault_prefill_delay_s=HANG_S,
                    prefill_timeout_s=0.25, stall_s=1.0, worker_metrics=False)
    w = worker_main.build_worker("prefill", cfg, 0, secret)
    client = WorkerClient("prefill", w.address, secret.worker_token)
    done = threading.Event()

    def prefill() -> None:
        try:
            client.prefill(build_request(list(range(1, 40)), max_tokens=4, method="native"), 60.0)
        except Exception:  # noqa: BLE001  (its publish to the absent bridge fails; the hang is the point)
            pass
        done.set()

    try:
        assert _serving(client)
        threading.Thread(target=prefill, daemon=True).start()
        t0 = time.monotonic()
        wait_until(lambda: not _serving(client), "Health to say the hung prefill worker is not serving",
                   timeout_s=HANG_S - 3.0, every_s=0.1)
        assert not done.is_set() and time.monotonic() - t0 >= 1.0  # during the hang, and not before its bound
        assert done.wait(HANG_S + 30.0)
        assert _serving(client), "serving again once the prefill ended"
    finally:
        client.close()
        w.stop()


def test_a_decode_worker_whose_step_hangs_says_not_serving_until_it_steps(dflash_pair, monkeypatch):  # noqa: F811
    gate, held = threading.Event(), threading.Event()
    real_step = Scheduler.step

    def step(self):  # the engine's step does not return (a kernel that never ends) until the gate opens
        if not gate.is_set():
            held.set()
            gate.wait(HANG_S)
        return real_step(self)

    monkeypatch.setattr(Scheduler, "step", step)
    secret = ClusterSecret.generate()
    w = worker_main.build_worker("decode", serve_cfg(dflash_pair, "local", prefill_timeout_s=0.25, stall_s=1.0,
                                                     worker_metrics=False), 0, secret)
    client = WorkerClient("decode", w.address, secret.worker_token)
    out: dict = {}

    def decode() -> None:
        try:
            req = pb.DecodeRequest(version=PROTOCOL_VERSION,
                                   request=build_request(list(range(1, 40)), max_tokens=4, method="native",
                                                         ignore_eos=True))
            out["chunks"] = list(client.decode(req, 60.0))
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=decode, daemon=True)
    try:
        assert _serving(client)
        t.start()
        assert held.wait(30.0)
        t0 = time.monotonic()
        wait_until(lambda: not _serving(client), "Health to say the hung decode worker is not serving",
                   timeout_s=HANG_S - 3.0, every_s=0.1)
        assert not gate.is_set() and time.monotonic() - t0 >= 0.5
        gate.set()  # the step returns: the request finishes and the worker serves again
        t.join(60.0)
        assert "error" not in out and out["chunks"][-1].finished, out
        assert _serving(client), "serving again once the engine stepped"
    finally:
        gate.set()
        client.close()
        w.stop()


_STOP_MID_PREFILL = r"""
import json, sys, threading, time
from flashpd.cluster import worker_main
from flashpd.cluster.config import ServeConfig
from flashpd.cluster.generation_client import build_request
from flashpd.cluster.worker_client import WorkerClient
from flashpd.kv_bridge.auth import ClusterSecret

cfg = ServeConfig.from_dict(json.loads(sys.argv[1]), "test")
secret = ClusterSecret.generate()
w = worker_main.build_worker("prefill", cfg, 0, secret)
client = WorkerClient("prefill", w.address, secret.worker_token)

def prefill():
    try:
        client.prefill(build_request(list(range(1, 40)), max_tokens=4, method="native"), 60.0)
    except Exception:
        pass  # its call is cancelled by the stop; the prefill itself goes on

threading.Thread(target=prefill, daemon=True).start()
while client.health(10.0)["running"] == 0:
    time.sleep(0.02)
w.stop()
time.sleep(cfg.fault_prefill_delay_s + 3.0)  # the prefill ends, restoring from the bridge meanwhile
print("survived", flush=True)
"""


def test_a_prefill_worker_stopped_mid_prefill_does_not_crash(dflash_pair):  # noqa: F811
    """The prefill, held 3 s by the fault delay, goes on to look its prefix up in the bridge after the worker's stop
    (its server stopped, its RPC cancelled: the handler thread cannot be): a worker restarted or shut down under
    load did so."""
    cfg = serve_cfg(dflash_pair, "local", bridge_address="127.0.0.1:1", fault_prefill_delay_s=3.0,
                    worker_metrics=False)
    r = subprocess.run([sys.executable, "-c", _STOP_MID_PREFILL, json.dumps(cfg.to_dict())], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stderr[-1500:])


_LAUNCHER = r"""
import json, os, sys, time
from flashpd.cluster.config import ServeConfig
from flashpd.cluster.launcher import WorkerSpec
from flashpd.cluster.local_launcher import LocalLauncher
from flashpd.kv_bridge.auth import ClusterSecret

cfg = ServeConfig.from_dict(json.loads(sys.argv[1]), "test")
launcher = LocalLauncher(sys.argv[2], secret=ClusterSecret.from_hex(os.environ["TEST_SECRET"]))
(w,) = launcher.start([WorkerSpec("prefill", 0, cfg)], 120.0)
print("WORKER", w.handle.proc.pid, w.address, flush=True)
time.sleep(600)
"""


def test_a_worker_whose_launcher_is_killed_while_a_prefill_hangs_still_exits(dflash_pair, tmp_path):  # noqa: F811
    """The launcher is SIGKILLed (no handler runs) while the worker's one prefill hangs (the fault delay, 600 s): the
    worker sees its launcher gone and stops, and its process must then end, not wait on that prefill."""
    secret = ClusterSecret.generate()
    cfg = serve_cfg(dflash_pair, "local", bridge_address="127.0.0.1:1", fault_prefill_delay_s=600.0,
                    worker_metrics=False)
    parent = subprocess.Popen([sys.executable, "-c", _LAUNCHER, json.dumps(cfg.to_dict()), str(tmp_path / "logs")],
                              stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, TEST_SECRET=secret.export_hex()))
    worker = None
    try:
        for ln in parent.stdout:
            if ln.startswith("WORKER "):
                _, pid, address = ln.split()
                worker = psutil.Process(int(pid))
                break
        assert worker is not None, "the worker did not start"
        client = WorkerClient("prefill", address, secret.worker_token)
        call = client.prefill_future(build_request(list(range(1, 40)), max_tokens=4, method="native"), 900.0)
        wait_until(lambda: client.health(10.0)["running"] == 1, "the prefill to run", every_s=0.05)
        parent.kill()
        parent.wait(10)
        # it notices within ~1 s, stops (its server's 1 s grace, ...), and exits within EXIT_GRACE_S (10 s) of that
        gone, _ = psutil.wait_procs([worker], timeout=45)
        assert gone, "the worker, its launcher gone, is still there"
        call.cancel()
        client.close()
    finally:
        if parent.poll() is None:
            parent.kill()
        if worker is not None and worker.is_running():
            worker.kill()


def test_a_dead_workers_shared_memory_is_removed_once_not_at_each_probe(tmp_path):
    """An exited worker's torch_<pid>_* files go when the launcher first reaps it. A dead slot is probed again and
    again until it restarts, and its pid is free after that first reap: a file of the pid's next owner must stay."""
    launcher = LocalLauncher(tmp_path / "logs")
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    child = _Child(WorkerSpec("prefill", 0, None), proc, tmp_path / "w.log")
    mine = Path(f"/dev/shm/torch_{proc.pid}_9_0")
    mine.write_bytes(b"x")  # as the worker's shared caches are named
    proc.wait(30)
    w = Launched("prefill", 0, "", None, child)
    try:
        assert not launcher.alive(w, 1.0) and not mine.exists()
        next_owner = Path(f"/dev/shm/torch_{proc.pid}_9_1")
        next_owner.write_bytes(b"y")
        assert not launcher.alive(w, 1.0)
        launcher.stop(w)
        assert next_owner.exists()
    finally:
        for f in Path("/dev/shm").glob(f"torch_{proc.pid}_9_*"):
            f.unlink()


def test_mode_ray_without_ray_installed_names_the_extra():
    """The quick start's install has no Ray: mode 'ray' ended in a ModuleNotFoundError traceback from
    cluster/ray_launcher.py. A child process where `import ray` fails stands for that install."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "from flashpd.cluster.config import ServeConfig\n"
            "from flashpd.cluster.service import make_launcher\n"
            "try:\n"
            "    make_launcher(ServeConfig.from_dict({'target': 't', 'mode': 'ray'}), None)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mode 'ray' needs Ray" in r.stdout and "'.[ray]'" in r.stdout, r.stdout

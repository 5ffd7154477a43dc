"""Workers as plain processes on this machine (`python -m flashpd.cluster.worker_main`), no Ray.

Each child gets its role and the config as JSON, prints `listening on ADDR` when it serves, logs
to its own file (whose tail is in the error when it fails to start), is placed on a GPU by
CUDA_VISIBLE_DEVICES (placement.local_gpu) and exits by itself when this process is gone. Each
child gets the launcher's cluster secret in FLASHPD_CLUSTER_SECRET (its environment, never its
command line, which any user of the machine can read).

start() waits for all its children at once: the first that exits while starting fails the start at once, named with
its log (a decode worker with a bad config is not reported only once a prefill worker beside it has warmed up, or as
the prefill worker that did not start in time); a spawn that fails stops the children already spawned. A child's
output is drained to its end by a reader thread that never dies on what it reads (an undecodable byte used to end
it: the start then waited out its timeout, and the child blocked once its pipe filled) and keeps nothing it prints
after `listening on`.

Each child is the leader of a process group of its own (start_new_session), and is stopped with it: a stop is a
SIGTERM to the child (it stops what it started itself), then a SIGKILL to its group, after the grace if it still runs
and at once if it exited, so nothing it started (a library's helper processes) outlives it; kill() is a SIGKILL to
the group. The group is signalled before the child is reaped, while its id can be no other group's, and never when
it is this process's own (it used to be the child alone: what it started outlived a worker killed by SIGKILL).

shutdown() ends a start in progress (its wait for `listening on` gives up at once, the child is stopped) and
refuses later starts, so a router stopping mid-restart is not held for the start timeout. The log directory
it made itself is removed by a clean shutdown; one given to it, or one holding the log of a worker that
failed (did not start, died, or needed a SIGKILL to stop), is kept and its path logged.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from flashpd.cluster.colocation import host_identity
from flashpd.cluster.launcher import Launched, WorkerSpec, WorkerStartError, unlink_shared_memory
from flashpd.cluster.placement import local_gpu
from flashpd.kv_bridge.auth import ClusterSecret

log = logging.getLogger(__name__)


def _cuda_count() -> int:
    try:
        import torch  # noqa: PLC0415

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001  no usable CUDA: CPU placement
        return 0


def visible_device(gpu: int, parent_visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES entry for a child pinned to this process's logical GPU `gpu`: under a parent
    mask ("2,3", UUIDs, MIG names) logical GPU i is the mask's i-th entry, not physical GPU i."""
    entries = [e.strip() for e in (parent_visible or "").split(",") if e.strip()]
    if not entries:
        return str(gpu)
    if gpu >= len(entries):
        raise ValueError(f"GPU {gpu} is not among this process's CUDA_VISIBLE_DEVICES={parent_visible!r}")
    return entries[gpu]


READY = "listening on "  # the line a worker prints once it serves (worker_main.main); METRICS before it
METRICS = "metrics on "


class _Child:
    """A worker process and the reader of its stdout. `lines` holds what it printed up to and including its
    `listening on` line, then None at the end of its output; what it prints later is read and dropped (nobody waits
    for it: kept, it would grow for the worker's whole life). `wake` is set after each line queued."""

    def __init__(self, spec: WorkerSpec, proc: subprocess.Popen, log_path: Path,
                 wake: threading.Event | None = None) -> None:
        self.spec = spec
        self.proc = proc
        self.log_path = log_path
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.metrics: str | None = None  # its `metrics on` address, once the start read it
        self._wake = wake
        self._shm_lock = threading.Lock()
        self._shm_done = False
        threading.Thread(target=self._read, daemon=True, name=f"{spec.role}{spec.index}-stdout").start()

    @property
    def name(self) -> str:
        return f"{self.spec.role} worker {self.spec.index}"

    def reaped(self) -> None:
        """Its shared-memory files removed, once: at the first reap this launcher sees. Its pid is free from then on,
        and a later call (a dead slot is probed until it restarts) would remove files of the pid's next owner."""
        with self._shm_lock:
            done, self._shm_done = self._shm_done, True
        if not done:
            unlink_shared_memory(self.proc.pid)

    def _put(self, ln: str | None) -> None:
        self.lines.put(ln)
        if self._wake is not None:
            self._wake.set()

    def _read(self) -> None:
        ready = False
        try:
            for ln in self.proc.stdout:  # keeps draining, so the pipe never fills
                if not ready:
                    self._put(ln.rstrip("\n"))
                    ready = ln.startswith(READY)
        except Exception:  # noqa: BLE001  logged; the end of its output is still told (else a start waits it out)
            log.exception("reading the output of the %s (pid %d)", self.name, self.proc.pid)
        finally:
            self._put(None)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class LocalLauncher:
    name = "local"

    def __init__(self, log_dir: str | Path | None = None, secret: ClusterSecret | None = None) -> None:
        self.secret = secret if secret is not None else ClusterSecret.generate()  # the workers' and the router's
        self._own_log_dir = not log_dir  # made here: removed by a clean shutdown
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="flashpd-workers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.gpus = _cuda_count()
        self._children: list[_Child] = []
        self._seq = 0
        self._lock = threading.Lock()  # _children and _closing: a restart's start may race shutdown()
        self._closing = threading.Event()
        self.failed_logs: list[Path] = []  # logs of workers that failed: their directory is kept
        self._host = host_identity()  # its children run here

    def _failed(self, c: _Child) -> None:
        if c.log_path not in self.failed_logs:
            self.failed_logs.append(c.log_path)

    def _spawn(self, spec: WorkerSpec, wake: threading.Event | None = None) -> _Child:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.secret.child_env())
        gpu = local_gpu(spec.role, spec.index, spec.cfg, self.gpus)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_device(gpu, os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._seq += 1
        log_path = self.log_dir / f"{spec.role}{spec.index}-{self._seq}.log"
        with open(log_path, "w") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flashpd.cluster.worker_main", "--role", spec.role,
                 "--config-json", json.dumps(spec.cfg.to_dict()), "--port", str(spec.port),
                 "--parent-pid", str(os.getpid())],
                stdout=subprocess.PIPE, stderr=logf, text=True, errors="replace", env=env, start_new_session=True)
        return _Child(spec, proc, log_path, wake)

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[Launched]:
        wake = threading.Event()  # set by the children's readers: a line, or the end of a child's output
        children: list[_Child] = []
        refused: tuple[WorkerSpec, Exception] | None = None
        with self._lock:  # a child spawned here is either refused or seen by shutdown(), never orphaned
            if self._closing.is_set():
                raise WorkerStartError("the launcher is shut down: no worker is started")
            for s in specs:
                try:
                    c = self._spawn(s, wake)
                except Exception as e:  # noqa: BLE001  (fork refused, log not writable, ...): the others go too
                    refused = (s, e)
                    break
                children.append(c)
                self._children.append(c)
        if refused is not None:
            self._stop_children(children, 5.0)
            s, e = refused
            raise WorkerStartError(f"{s.role} worker {s.index} could not be spawned: {type(e).__name__}: {e}") from e
        try:
            return self._wait_ready(children, time.monotonic() + timeout_s, wake)
        except BaseException:
            self._stop_children(children, 5.0)
            raise

    def _wait_ready(self, children: list[_Child], deadline: float, wake: threading.Event) -> list[Launched]:
        """Every child's `listening on`, all waited for at once: the first to exit fails the start then, not once
        those before it are ready."""
        ready: dict[_Child, Launched] = {}
        while True:
            wake.clear()  # before reading: a line that comes after the reads below sets it again
            for c in children:
                if c not in ready and (w := self._read_start(c)) is not None:
                    ready[c] = w
            pending = [c for c in children if c not in ready]
            if not pending:
                return [ready[c] for c in children]
            if self._closing.is_set():
                raise WorkerStartError(f"{pending[0].name}: the launcher shut down while it started")
            left = deadline - time.monotonic()
            if left <= 0:
                for c in pending:
                    self._failed(c)
                c = pending[0]
                also = f" (nor did {', '.join(o.name for o in pending[1:])})" if len(pending) > 1 else ""
                raise WorkerStartError(f"{c.name} did not start in time{also}; log {c.log_path}:\n{c.log_tail()}")
            wake.wait(min(left, 1.0))

    def _read_start(self, c: _Child) -> Launched | None:
        """What the child printed so far: its Launched once it is listening, None while it starts; raises
        WorkerStartError when it exited first."""
        while True:
            try:
                ln = c.lines.get_nowait()
            except queue.Empty:
                return None
            if ln is None:
                if self._closing.is_set():
                    return None  # stopped by shutdown(): raised by the caller, not a failure of its own
                self._failed(c)
                try:
                    c.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass  # its output ended, the process not yet: its exit status is None
                raise WorkerStartError(f"{c.name} exited with {c.proc.returncode} while starting; log "
                                       f"{c.log_path}:\n{c.log_tail()}")
            if ln.startswith(METRICS):
                c.metrics = ln.split()[-1]
            elif ln.startswith(READY):
                return Launched(c.spec.role, c.spec.index, ln.split()[-1], c.metrics, c, self._host)

    def _stop_children(self, children: list[_Child], timeout_s: float) -> None:
        """SIGTERM to all at once, then each waited for (a SIGKILL after timeout_s)."""
        for c in children:
            if not _exited(c.proc, 0):
                _terminate(c.proc)
        for c in children:
            self._kill(c, timeout_s, terminated=True)

    def processes(self) -> list[subprocess.Popen]:
        """The worker processes this launcher started and has not stopped."""
        return [c.proc for c in self._children]

    def alive(self, w: Launched, timeout_s: float) -> bool:
        if w.handle.proc.poll() is None:
            return True
        self._failed(w.handle)  # died by itself (or was killed): its log is kept
        w.handle.reaped()
        return False

    def kill(self, w: Launched) -> None:
        """SIGKILL, no grace (what a crash looks like; tests use it), to its whole process group: what it started
        goes with it."""
        p = w.handle.proc
        _signal_group(p, signal.SIGKILL)
        p.wait(10)
        w.handle.reaped()
        with self._lock:  # stopped: no longer one of processes()
            if w.handle in self._children:
                self._children.remove(w.handle)

    def stop(self, w: Launched, timeout_s: float = 10.0) -> None:
        self._kill(w.handle, timeout_s)

    def _kill(self, c: _Child, timeout_s: float, terminated: bool = False) -> None:
        """SIGTERM (a graceful stop: it stops what it started itself; not again when `terminated`: a second one
        lands in the child's handler for the first), SIGKILL to its process group after timeout_s; once it has
        exited, what it started and left running (the rest of its group) is SIGKILLed too."""
        p = c.proc
        if not _exited(p, 0):
            if not terminated:
                _terminate(p)
            if not _exited(p, timeout_s):
                self._failed(c)  # hung: its log says where
        # the child if it hangs, and what it left running (it died, or did not stop them): before it is reaped, so
        # the group's id cannot be another group's yet (a child reaped elsewhere, e.g. by alive(): see _signal_group)
        _signal_group(p, signal.SIGKILL)
        try:
            p.wait(10)
            c.reaped()
        except subprocess.TimeoutExpired:  # not even SIGKILL ended it (a process stuck in the kernel)
            log.error("the %s (pid %d) did not exit after SIGKILL", c.name, p.pid)
        with self._lock:
            if c in self._children:
                self._children.remove(c)

    def shutdown(self) -> None:
        """Stop every worker (a start in progress included); then remove the log directory this launcher
        made unless a worker failed (its logs are kept for a look, and where they are is logged)."""
        with self._lock:
            self._closing.set()
            children = list(self._children)
        for c in children:
            if not _exited(c.proc, 0):
                _terminate(c.proc)
            else:
                self._failed(c)  # it had exited by itself
        for c in children:
            self._kill(c, 10.0, terminated=True)
        self._clean_logs()

    def _clean_logs(self) -> None:
        if self.failed_logs:
            log.warning("worker logs kept in %s (failed: %s)", self.log_dir,
                        ", ".join(p.name for p in self.failed_logs))
        elif self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _terminate(p: subprocess.Popen) -> None:
    """SIGTERM to the child (it stops what it started itself), and SIGCONT to its group so that a stopped child
    (SIGSTOP, a debugger's) sees it rather than the grace."""
    try:
        p.send_signal(signal.SIGTERM)
    except ProcessLookupError:  # exited meanwhile
        pass
    _signal_group(p, signal.SIGCONT)


def _exited(p: subprocess.Popen, timeout_s: float) -> bool:
    """Whether the child has exited, waiting up to timeout_s, WITHOUT reaping it: until it is reaped (a zombie keeps its
    pid) its process group's id cannot be given to another process, so signalling that group reaches only what the
    child started. Reaped already (Popen.poll or wait elsewhere, e.g. a liveness check): True."""
    deadline = time.monotonic() + timeout_s
    while p.returncode is None:
        try:
            if not hasattr(os, "waitid"):  # (macOS): reaped then, see _signal_group
                if p.poll() is not None:
                    return True
            elif os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped by another thread meanwhile
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
    return True


def _signal_group(p: subprocess.Popen, sig: int) -> bool:
    """sig to the child's process group: its own (start_new_session: its pid is the group's id), so the processes it
    started (a compiler's, a library's workers) get it too; never to this process's own group. The group's id is
    the child's alone while the child is unreaped (see _exited). Once it is reaped (a liveness check's poll() saw it
    die), the id still names its group as long as that has a process left (the kernel does not reuse it meanwhile);
    only a group emptied, its id reused by a new group leader, and both between the reap and this call, would be hit
    instead. False: there was no such group (any more)."""
    pgid = p.pid
    if pgid == os.getpgrp():  # not its own group after all: never signal ours
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            return False
        return True
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # its id is not ours to signal (the child changed its group's owner): leave it
        log.warning("not allowed to signal process group %d (the worker's, pid %d)", pgid, p.pid)
        return False
    return True

"""Workers as plain processes on this machine (`python -m flashpd.cluster.worker_main`), no Ray.

Each child gets its role and the config as JSON, prints `listening on ADDR` when it serves, logs
to its own file (whose tail is in the error when it fails to start), is placed on a GPU by
CUDA_VISIBLE_DEVICES (placement.local_gpu) and exits by itself when this process is gone. Each
child gets the launcher's cluster secret in FLASHPD_CLUSTER_SECRET (its environment, never its
command line, which any user of the machine can read).

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

from flashpd.cluster.launcher import Launched, WorkerSpec, WorkerStartError
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


class _Child:
    def __init__(self, spec: WorkerSpec, proc: subprocess.Popen, log_path: Path) -> None:
        self.spec = spec
        self.proc = proc
        self.log_path = log_path
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"{spec.role}{spec.index}-stdout").start()

    def _read(self) -> None:
        for ln in self.proc.stdout:  # keeps draining, so the pipe never fills
            self.lines.put(ln.rstrip("\n"))
        self.lines.put(None)

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

    def _failed(self, c: _Child) -> None:
        if c.log_path not in self.failed_logs:
            self.failed_logs.append(c.log_path)

    def _spawn(self, spec: WorkerSpec) -> _Child:
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
                stdout=subprocess.PIPE, stderr=logf, text=True, env=env, start_new_session=True)
        return _Child(spec, proc, log_path)

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[Launched]:
        with self._lock:  # a child spawned here is either refused or seen by shutdown(), never orphaned
            if self._closing.is_set():
                raise WorkerStartError("the launcher is shut down: no worker is started")
            children = [self._spawn(s) for s in specs]
            self._children.extend(children)
        deadline = time.monotonic() + timeout_s
        out = []
        try:
            for c in children:
                out.append(self._wait_ready(c, deadline))
        except BaseException:
            for c in children:
                self._kill(c, 5.0)
            raise
        return out

    def _wait_ready(self, c: _Child, deadline: float) -> Launched:
        metrics = None
        while True:
            if self._closing.is_set():
                raise WorkerStartError(f"{c.spec.role} worker {c.spec.index}: the launcher shut down while it started")
            left = deadline - time.monotonic()
            if left <= 0:
                self._failed(c)
                raise WorkerStartError(f"{c.spec.role} worker {c.spec.index} did not start in time; log "
                                       f"{c.log_path}:\n{c.log_tail()}")
            try:
                ln = c.lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if ln is None:
                if self._closing.is_set():
                    continue  # stopped by shutdown(): raised above, not a failure of its own
                self._failed(c)
                c.proc.wait(5)
                raise WorkerStartError(f"{c.spec.role} worker {c.spec.index} exited with {c.proc.returncode} while "
                                       f"starting; log {c.log_path}:\n{c.log_tail()}")
            if ln.startswith("metrics on "):
                metrics = ln.split()[-1]
            elif ln.startswith("listening on "):
                return Launched(c.spec.role, c.spec.index, ln.split()[-1], metrics, c)

    def processes(self) -> list[subprocess.Popen]:
        """The worker processes this launcher started and has not stopped."""
        return [c.proc for c in self._children]

    def alive(self, w: Launched, timeout_s: float) -> bool:
        if w.handle.proc.poll() is None:
            return True
        self._failed(w.handle)  # died by itself (or was killed): its log is kept
        return False

    def kill(self, w: Launched) -> None:
        """SIGKILL, no grace (what a crash looks like; tests use it)."""
        w.handle.proc.kill()
        w.handle.proc.wait(10)

    def stop(self, w: Launched, timeout_s: float = 10.0) -> None:
        self._kill(w.handle, timeout_s)

    def _kill(self, c: _Child, timeout_s: float) -> None:
        p = c.proc
        if p.poll() is None:
            _terminate(p)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._failed(c)  # hung: its log says where
                p.kill()
                p.wait(10)
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
            if c.proc.poll() is None:
                _terminate(c.proc)
            else:
                self._failed(c)  # it had exited by itself
        for c in children:
            self._kill(c, 10.0)
        self._clean_logs()

    def _clean_logs(self) -> None:
        if self.failed_logs:
            log.warning("worker logs kept in %s (failed: %s)", self.log_dir,
                        ", ".join(p.name for p in self.failed_logs))
        elif self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _terminate(p: subprocess.Popen) -> None:
    """SIGTERM, and SIGCONT so that a stopped child (SIGSTOP, a debugger's) sees it rather than the grace."""
    try:
        p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGCONT)
    except ProcessLookupError:  # exited meanwhile
        pass

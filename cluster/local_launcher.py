"""Workers as plain processes on this machine (`python -m flashpd.cluster.worker_main`), no Ray.

Each child gets its role and the config as JSON, prints `listening on ADDR` when it serves, logs
to its own file (whose tail is in the error when it fails to start), is placed on a GPU by
CUDA_VISIBLE_DEVICES (placement.local_gpu) and exits by itself when this process is gone. Each
child gets the launcher's cluster secret in FLASHPD_CLUSTER_SECRET (its environment, never its
command line, which any user of the machine can read).
"""
from __future__ import annotations

import json
import os
import queue
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
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="flashpd-workers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.gpus = _cuda_count()
        self._children: list[_Child] = []
        self._seq = 0

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
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartError(f"{c.spec.role} worker {c.spec.index} did not start in time; log "
                                       f"{c.log_path}:\n{c.log_tail()}")
            try:
                ln = c.lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if ln is None:
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
        return w.handle.proc.poll() is None

    def kill(self, w: Launched) -> None:
        """SIGKILL, no grace (what a crash looks like; tests use it)."""
        w.handle.proc.kill()
        w.handle.proc.wait(10)

    def stop(self, w: Launched, timeout_s: float = 10.0) -> None:
        self._kill(w.handle, timeout_s)

    def _kill(self, c: _Child, timeout_s: float) -> None:
        p = c.proc
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if c in self._children:
            self._children.remove(c)

    def shutdown(self) -> None:
        for c in list(self._children):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        for c in list(self._children):
            self._kill(c, 10.0)

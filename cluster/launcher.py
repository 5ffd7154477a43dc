"""What the router needs of a launcher: start workers, tell whether one lives, stop one.

Two launchers implement it: LocalLauncher (plain processes on this machine, no Ray) and
RayLauncher (Ray actors, placed by placement.py). The router and its supervision are the same
over both. Every call is bounded: start by a timeout, alive by a probe timeout, stop by a grace.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    role: str  # bridge | prefill | decode
    index: int
    cfg: Any  # ServeConfig (with bridge_address set for prefill / decode)
    port: int = 0  # 0: any free port (a restarted bridge asks for its old one)


@dataclass
class Launched:
    role: str
    index: int
    address: str
    metrics_address: str | None
    handle: Any  # the process or the actor
    host: dict | None = None  # colocation.host_identity() of the worker's process (None: unknown, not checked)


class WorkerStartError(RuntimeError):
    """A worker did not come up in time, or exited while starting (the message has its log's tail)."""


class Launcher(Protocol):
    name: str
    secret: Any  # kv_bridge.auth.ClusterSecret: handed to every worker it starts, never on a command line

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[Launched]: ...

    def alive(self, w: Launched, timeout_s: float) -> bool: ...

    def stop(self, w: Launched, timeout_s: float = 10.0) -> None: ...

    def shutdown(self) -> None: ...


def unlink_shared_memory(pid: int, shm_dir: Path = Path("/dev/shm")) -> int:
    """Remove the shared-memory files an exited worker made (torch's file_system strategy names them torch_<pid>_*:
    a CPU prefill worker's caches on the device path). torch's manager unlinks them when its worker is gone, but a
    manager killed with its worker (Ray kills an actor's whole process tree) never does: each crash left a whole KV
    cache in /dev/shm. Unlinked, the memory goes as the last mapping does (a decode worker maps an exporter's files
    itself, kv_bridge/host_share.py, and drops a dead exporter's at its successor's first handoff). Returns how
    many were removed."""
    n = 0
    for f in shm_dir.glob(f"torch_{pid}_*"):
        try:
            f.unlink()
            n += 1
        except OSError:  # gone meanwhile, or not ours
            pass
    if n:
        log.info("removed %d shared-memory file(s) of exited worker pid %d", n, pid)
    return n

"""What the router needs of a launcher: start workers, tell whether one lives, stop one.

Two launchers implement it: LocalLauncher (plain processes on this machine, no Ray) and
RayLauncher (Ray actors, placed by placement.py). The router and its supervision are the same
over both. Every call is bounded: start by a timeout, alive by a probe timeout, stop by a grace.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


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


class WorkerStartError(RuntimeError):
    """A worker did not come up in time, or exited while starting (the message has its log's tail)."""


class Launcher(Protocol):
    name: str
    secret: Any  # kv_bridge.auth.ClusterSecret: handed to every worker it starts, never on a command line

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[Launched]: ...

    def alive(self, w: Launched, timeout_s: float) -> bool: ...

    def stop(self, w: Launched, timeout_s: float = 10.0) -> None: ...

    def shutdown(self) -> None: ...

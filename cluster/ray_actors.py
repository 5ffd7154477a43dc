"""The Ray actor that hosts one worker (bridge, prefill or decode) in its own process.

It builds the same worker as the local launcher's child process (worker_main.build_worker),
advertising its node's address when the service is exposed beyond loopback. The router talks to
the worker over gRPC; Ray places it (placement.py), and tells the router when it is dead. The
cluster secret comes as an argument (hex) and goes straight to the worker, never to the log.

The worker is built by start(), not the constructor: an exception in a method reaches the launcher as
itself (RayTaskError.cause: a bad config's ValueError, say), where one in the constructor comes back only
as the text of the whole remote traceback. where() tells the launcher which process to wait for once it
has killed the actor (ray.kill returns before that process has exited and let go of its ports).
"""
from __future__ import annotations

import os

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.worker_main import RunningWorker, build_worker
from flashpd.kv_bridge.auth import ClusterSecret


class WorkerActor:
    def __init__(self, role: str, cfg: dict, port: int = 0, secret_hex: str | None = None) -> None:
        import logging  # noqa: PLC0415

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
        self.role, self._cfg, self._port, self._secret_hex = role, cfg, port, secret_hex
        self.worker: RunningWorker | None = None

    def where(self) -> tuple[int, str]:
        """(this process's pid, its Ray node id)."""
        import ray  # noqa: PLC0415

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def start(self) -> tuple[str, str | None, dict]:
        """Build and serve the worker; (its address, its metrics address, its host: colocation.host_identity)."""
        import logging  # noqa: PLC0415

        import ray  # noqa: PLC0415

        os.environ.setdefault("FLASHPD_ADVERTISE_HOST", ray.util.get_node_ip_address())
        secret = ClusterSecret.from_hex(self._secret_hex, "actor secret") if self._secret_hex else None
        self.worker = self._build(self.role, ServeConfig.from_dict(self._cfg, f"{self.role} actor config"),
                                  self._port, secret)
        # where Ray put this worker, in the service's log (a sweep keeps that log beside its JSON)
        logging.getLogger("flashpd.ray_actor").info(
            "%s worker placed on node %s, Ray GPU ids %s, CUDA_VISIBLE_DEVICES=%s", self.role,
            ray.util.get_node_ip_address(), ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        return self.info()

    def _build(self, role: str, cfg: ServeConfig, port: int, secret: ClusterSecret | None) -> RunningWorker:
        return build_worker(role, cfg, port, secret)

    def info(self) -> tuple[str, str | None, dict]:
        from flashpd.cluster.colocation import host_identity  # noqa: PLC0415

        return self.worker.address, self.worker.metrics_address, host_identity()

    def ping(self) -> bool:
        return self.worker is not None and self.worker.alive()

    def stop(self) -> None:
        """Stop the worker gracefully (its servers, then what it has queued: a bridge's disk writes)."""
        if self.worker is not None:
            self.worker.stop()

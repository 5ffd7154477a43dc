"""The Ray actor that hosts one worker (bridge, prefill or decode) in its own process.

It builds the same worker as the local launcher's child process (worker_main.build_worker),
advertising its node's address when the service is exposed beyond loopback. The router talks to
the worker over gRPC; Ray places it (placement.py), and tells the router when it is dead. The
cluster secret comes as an argument (hex) and goes straight to the worker, never to the log.
"""
from __future__ import annotations

import os

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.worker_main import build_worker
from flashpd.kv_bridge.auth import ClusterSecret


class WorkerActor:
    def __init__(self, role: str, cfg: dict, port: int = 0, secret_hex: str | None = None) -> None:
        import logging  # noqa: PLC0415

        import ray  # noqa: PLC0415

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
        os.environ.setdefault("FLASHPD_ADVERTISE_HOST", ray.util.get_node_ip_address())
        secret = ClusterSecret.from_hex(secret_hex, "actor secret") if secret_hex else None
        self.worker = build_worker(role, ServeConfig.from_dict(cfg, f"{role} actor config"), port, secret)
        # where Ray put this worker, in the service's log (a sweep keeps that log beside its JSON)
        logging.getLogger("flashpd.ray_actor").info(
            "%s worker placed on node %s, Ray GPU ids %s, CUDA_VISIBLE_DEVICES=%s", role,
            ray.util.get_node_ip_address(), ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))

    def info(self) -> tuple[str, str | None]:
        return self.worker.address, self.worker.metrics_address

    def ping(self) -> bool:
        return self.worker.alive()

    def stop(self) -> None:
        self.worker.stop()

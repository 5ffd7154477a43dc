"""Workers as Ray actors: placed by placement.ray_options, probed with ray.get(ping, timeout), killed
with ray.kill. The router restarts a dead one itself (a new actor; Ray's own restarts are off), so
it learns the new worker's address. Each actor gets the launcher's cluster secret as a constructor
argument (not a runtime_env variable, which Ray's dashboard and state API show)."""
from __future__ import annotations

import logging

import ray
from ray.exceptions import GetTimeoutError, RayError

from flashpd.cluster.launcher import Launched, WorkerSpec, WorkerStartError
from flashpd.cluster.placement import ray_options
from flashpd.cluster.ray_actors import WorkerActor
from flashpd.kv_bridge.auth import ClusterSecret

log = logging.getLogger(__name__)


class RayLauncher:
    name = "ray"

    def __init__(self, address: str | None = None, secret: ClusterSecret | None = None) -> None:
        self.secret = secret if secret is not None else ClusterSecret.generate()  # the workers' and the router's
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address)  # inside a Ray job this joins the job's cluster
        self.actor_cls = ray.remote(max_restarts=0)(WorkerActor)
        self._actors: list = []

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[Launched]:
        resources = ray.cluster_resources()
        actors = []
        for s in specs:
            opts = ray_options(s.role, s.cfg, resources)
            log.info("starting %s worker %d as a Ray actor with %s", s.role, s.index, opts)
            actors.append(self.actor_cls.options(**opts).remote(s.role, s.cfg.to_dict(), s.port,
                                                                self.secret.export_hex()))
        self._actors.extend(actors)
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=timeout_s)
        except (GetTimeoutError, RayError) as e:
            for a in actors:
                self._kill(a)
            raise WorkerStartError(f"Ray workers {[(s.role, s.index) for s in specs]} did not start: {e}") from e
        return [Launched(s.role, s.index, addr, maddr, a) for s, a, (addr, maddr) in zip(specs, actors, infos)]

    def alive(self, w: Launched, timeout_s: float) -> bool:
        try:
            return bool(ray.get(w.handle.ping.remote(), timeout=timeout_s))
        except (GetTimeoutError, RayError):
            return False

    def kill(self, w: Launched) -> None:
        """No grace (what a crash looks like; tests use it)."""
        self._kill(w.handle)

    def stop(self, w: Launched, timeout_s: float = 10.0) -> None:
        try:
            ray.get(w.handle.stop.remote(), timeout=timeout_s)
        except (GetTimeoutError, RayError):
            pass  # dead or stuck: killed below either way
        self._kill(w.handle)

    def _kill(self, actor) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except RayError:
            log.exception("ray.kill failed")
        if actor in self._actors:
            self._actors.remove(actor)

    def shutdown(self) -> None:
        for a in list(self._actors):
            self._kill(a)
        if self._owns_ray:
            ray.shutdown()

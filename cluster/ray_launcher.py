"""Workers as Ray actors: placed by placement.ray_options, probed with ray.get(ping, timeout), killed
with ray.kill. The router restarts a dead one itself (a new actor; Ray's own restarts are off), so
it learns the new worker's address. Each actor gets the launcher's cluster secret as a constructor
argument (not a runtime_env variable, which Ray's dashboard and state API show).

A worker that fails to start raises WorkerStartError in one line: the worker, the original exception's
type and message (a bad config's ValueError, say); the remote traceback goes to the debug log. Stopping a
worker, or shutting down, first asks each started actor to stop gracefully (its servers, then what it has
queued, e.g. the bridge's disk writes), bounded by a grace, then kills it, then waits (bounded) until its
process has exited: ray.kill returns at once and Ray reports the actor dead before its process is gone
with its ports, so a restart on the same port would race it.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from flashpd.cluster.launcher import Launched, WorkerSpec, WorkerStartError
from flashpd.cluster.placement import ray_options
from flashpd.cluster.ray_actors import WorkerActor
from flashpd.kv_bridge.auth import ClusterSecret

log = logging.getLogger(__name__)


def process_gone(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` of this host is gone, waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # there, another user's
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


@functools.cache
def _remote_process_gone():
    """process_gone as a Ray task, run on the node of a killed actor of another host."""
    return ray.remote(num_cpus=0, max_retries=0)(process_gone)


def start_error(role: str, index: int, e: RayError) -> str:
    """One line for a worker that did not start: the exception its start raised (type and message), else the
    last line of a failed constructor's traceback, else what Ray says of the dead actor."""
    if isinstance(e, RayTaskError):
        why = f"{type(e.cause).__name__}: {' '.join(str(e.cause).split())}"
    elif isinstance(e, RayActorError) and e.actor_init_failed:
        why = str(e).strip().splitlines()[-1].strip()
    else:
        why = " ".join(str(e).split())
    return f"{role} worker {index} did not start: {why}"


@dataclass
class _Actor:
    name: str  # "decode worker 1"
    started: bool = False  # its worker started: a graceful stop is worth asking
    where: tuple[int, str] | None = None  # (its process's pid, its node id), once it said


class RayLauncher:
    name = "ray"
    shutdown_grace_s = 10.0  # bound on the actors' graceful stop at shutdown (all at once)
    exit_wait_s = 10.0  # bound on waiting for killed actors' processes to exit

    def __init__(self, address: str | None = None, secret: ClusterSecret | None = None) -> None:
        self.secret = secret if secret is not None else ClusterSecret.generate()  # the workers' and the router's
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address)  # inside a Ray job this joins the job's cluster
        self.actor_cls = ray.remote(max_restarts=0)(WorkerActor)
        self._actors: dict = {}  # actor handle -> _Actor, until it is killed
        self._node = ray.get_runtime_context().get_node_id()  # this process's node: its actors' pids checked here

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[Launched]:
        resources = ray.cluster_resources()
        actors = []
        for s in specs:
            opts = ray_options(s.role, s.cfg, resources)
            log.info("starting %s worker %d as a Ray actor with %s", s.role, s.index, opts)
            actors.append(self.actor_cls.options(**opts).remote(s.role, s.cfg.to_dict(), s.port,
                                                                self.secret.export_hex()))
            self._actors[actors[-1]] = _Actor(f"{s.role} worker {s.index}")
        wheres = [a.where.remote() for a in actors]
        starts = [a.start.remote() for a in actors]
        try:
            infos = self._wait_started(specs, actors, wheres, starts, timeout_s)
        except BaseException:
            self._kill_all([a for a in actors if a in self._actors])  # (a shutdown meanwhile killed them)
            raise
        for a in actors:
            self._actors[a].started = True
        return [Launched(s.role, s.index, addr, maddr, a) for s, a, (addr, maddr) in zip(specs, actors, infos)]

    def _wait_started(self, specs, actors, wheres, starts, timeout_s: float) -> list[tuple[str, str | None]]:
        """Each start's answer; the first to fail (not waiting for the others) raised as WorkerStartError in one
        line, its remote traceback logged at debug level."""
        deadline = time.monotonic() + timeout_s
        pending = list(starts)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._note_where(actors, wheres, 1.0)
                late = [(s.role, s.index) for s, ref in zip(specs, starts) if ref in pending]
                raise WorkerStartError(f"Ray workers {late} did not start in {timeout_s:g} s")
            s = specs[starts.index(ready[0])]
            try:
                ray.get(ready[0], timeout=0)
            except RayError as e:
                log.debug("%s worker %d did not start:\n%s", s.role, s.index, e)
                self._note_where(actors, wheres, 1.0)
                raise WorkerStartError(start_error(s.role, s.index, e)) from None
        self._note_where(actors, wheres, 10.0)
        return ray.get(starts, timeout=0)

    def _note_where(self, actors: list, wheres: list, timeout_s: float) -> None:
        """Which process each actor runs in, as far as it said within timeout_s (waited for once it is killed;
        each asked before its start, so a started one has said)."""
        ready, _ = ray.wait(wheres, num_returns=len(wheres), timeout=timeout_s)
        for a, ref in zip(actors, wheres):
            if ref in ready and a in self._actors:
                try:
                    self._actors[a].where = ray.get(ref, timeout=0)
                except RayError:
                    pass  # died before it said: waited for through Ray alone when killed

    def alive(self, w: Launched, timeout_s: float) -> bool:
        try:
            return bool(ray.get(w.handle.ping.remote(), timeout=timeout_s))
        except (GetTimeoutError, RayError):
            return False

    def kill(self, w: Launched) -> None:
        """No grace (what a crash looks like; tests use it)."""
        self._kill_all([w.handle])

    def stop(self, w: Launched, timeout_s: float = 10.0) -> None:
        self._stop_all([w.handle], timeout_s)
        self._kill_all([w.handle])

    def _stop_all(self, actors: list, timeout_s: float) -> None:
        """Ask started actors to stop gracefully, all at once, bounded by timeout_s (a stuck one is killed next)."""
        started = [(a, self._actors[a].name) for a in actors if a in self._actors and self._actors[a].started]
        refs = {a.stop.remote(): name for a, name in started}
        if not refs:
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref, name in refs.items():
            if ref not in ready:
                log.warning("the %s (a Ray actor) did not stop in %g s: killed", name, timeout_s)
                continue
            try:
                ray.get(ref, timeout=0)
            except RayError as e:  # dead already, or its stop failed: killed below either way
                log.debug("stopping the %s (a Ray actor): %s", name, e)

    def _kill_all(self, actors: list) -> None:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except RayError:
                log.exception("ray.kill failed")
        deadline = time.monotonic() + self.exit_wait_s
        for a in actors:
            rec = self._actors.pop(a, None) or _Actor("Ray worker")
            if not self._wait_exited(a, rec.where, deadline):
                log.warning("the killed %s's process is still there after %g s", rec.name, self.exit_wait_s)

    def _wait_exited(self, actor, where: tuple[int, str] | None, deadline: float) -> bool:
        """Until the killed actor's process has exited: checked here when it ran on this node, else by a task
        on its node; an actor that never said where it runs, until Ray reports it dead."""
        if where is None:
            return self._wait_reported_dead(actor, deadline)
        pid, node = where
        left = max(0.0, deadline - time.monotonic())
        if node == self._node:
            return process_gone(pid, left)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

        task = _remote_process_gone().options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        try:
            return bool(ray.get(task.remote(pid, left), timeout=left + 5.0))
        except (GetTimeoutError, RayError) as e:  # its node gone too (its processes with it), or unreachable
            log.debug("waiting for a killed Ray worker's process on node %s: %s", node, e)
            return not isinstance(e, GetTimeoutError)

    @staticmethod
    def _wait_reported_dead(actor, deadline: float) -> bool:
        """Until a call to the actor fails as to a dead one (Ray may say so before its process is gone)."""
        while time.monotonic() < deadline:
            try:
                ray.get(actor.ping.remote(), timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            except RayActorError:
                return True
            except (GetTimeoutError, RayError):
                pass
            time.sleep(0.01)
        return False

    def shutdown(self) -> None:
        """Every actor: a graceful stop (bounded by shutdown_grace_s), then killed and waited for; an actor
        still starting is killed at once (its start has nothing queued yet)."""
        actors = list(self._actors)
        try:
            self._stop_all(actors, self.shutdown_grace_s)
        finally:
            self._kill_all(actors)
            if self._owns_ray:
                ray.shutdown()

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

shutdown() refuses later starts (a restart racing it would otherwise create an actor nobody kills: in a cluster this
process joined, it held its GPU for as long as the cluster ran). alive() is False only when Ray says the actor is
dead (or its ping fails): a ping not answered in time is a busy or hung process, which the pool's Health probe judges
with its failures in a row (a timeout used to count as dead, so a worker slow to answer under load was restarted at
once); a ping left unanswered is waited for again by the next alive(), never sent twice. A start that times out says
which workers Ray never placed and what they ask for against what the cluster has (a GPU share on a cluster without
GPUs waited out the whole start timeout, then said only "did not start"); one not placed within `place_warn_s` is
logged as such meanwhile.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from flashpd.cluster.launcher import Launched, WorkerSpec, WorkerStartError, unlink_shared_memory
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


def gone_and_cleaned(pid: int, timeout_s: float) -> bool:
    """process_gone, then the shared-memory files the process left removed (launcher.unlink_shared_memory): a killed
    actor's torch_shm_manager dies with it before unlinking them, so a CPU prefill worker's caches stayed in
    /dev/shm after every crash, stop and job stop."""
    gone = process_gone(pid, timeout_s)
    if gone:
        unlink_shared_memory(pid)
    return gone


@functools.cache
def _remote_process_gone():
    """gone_and_cleaned as a Ray task, run on the node of a killed actor of another host."""
    return ray.remote(num_cpus=0, max_retries=0)(gone_and_cleaned)


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
    opts: dict | None = None  # what it was placed with (ray_options)


class RayLauncher:
    name = "ray"
    shutdown_grace_s = 10.0  # bound on the actors' graceful stop at shutdown (all at once)
    exit_wait_s = 10.0  # bound on waiting for killed actors' processes to exit
    place_warn_s = 30.0  # a starting actor Ray has not placed this long is logged (what it asks for, what there is)

    def __init__(self, address: str | None = None, secret: ClusterSecret | None = None) -> None:
        self.secret = secret if secret is not None else ClusterSecret.generate()  # the workers' and the router's
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            main = threading.current_thread() is threading.main_thread()
            term = signal.getsignal(signal.SIGTERM) if main else None
            ray.init(address=address)  # inside a Ray job this joins the job's cluster
            if term is not None:  # ray.init takes SIGTERM over: a SIGTERM while starting then skipped the start's
                signal.signal(signal.SIGTERM, term)  # cleanup (cli_serve's handler) and left the workers' shm files
        self.actor_cls = ray.remote(max_restarts=0)(WorkerActor)
        self._actors: dict = {}  # actor handle -> _Actor, until it is killed
        self._pings: dict = {}  # actor handle -> its ping not answered yet (alive() waits for it again)
        # (role, index) -> the options its first start was placed with: a restart asks for the same (a snapshot of
        # the cluster after a node died gave a GPU worker no GPU and dropped its node-type pin, and it was placed at
        # once on a node of another role, to fail there until the pool gave the slot up)
        self._placed: dict[tuple[str, int], dict] = {}
        self._lock = threading.Lock()  # _actors' additions and _closing: a restart's start may race shutdown()
        self._closing = False
        self._node = ray.get_runtime_context().get_node_id()  # this process's node: its actors' pids checked here

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[Launched]:
        actors = []
        with self._lock:  # an actor created here is either refused or seen by shutdown(), never left running
            if self._closing:
                raise WorkerStartError("the launcher is shut down: no worker is started")
            resources = ray.cluster_resources()
            for s in specs:
                opts = self._placed.setdefault((s.role, s.index), ray_options(s.role, s.cfg, resources))
                log.info("starting %s worker %d as a Ray actor with %s", s.role, s.index, opts)
                # paths made absolute here: an actor resolved a relative one where `ray start` ran
                actors.append(self.actor_cls.options(**opts).remote(s.role, s.cfg.with_absolute_paths().to_dict(),
                                                                    s.port, self.secret.export_hex()))
                self._actors[actors[-1]] = _Actor(f"{s.role} worker {s.index}", opts=opts)
        wheres = [a.where.remote() for a in actors]
        starts = [a.start.remote() for a in actors]
        try:
            infos = self._wait_started(specs, actors, wheres, starts, timeout_s)
        except BaseException:
            self._kill_all([a for a in actors if a in self._actors])  # (a shutdown meanwhile killed them)
            raise
        for a in actors:
            self._actors[a].started = True
        return [Launched(s.role, s.index, addr, maddr, a, host) for s, a, (addr, maddr, host) in zip(specs, actors, infos)]

    def _wait_started(self, specs, actors, wheres, starts, timeout_s: float) -> list[tuple[str, str | None, dict]]:
        """Each start's answer; the first to fail (not waiting for the others) raised as WorkerStartError in one
        line, its remote traceback logged at debug level. Not placed within place_warn_s: logged."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        warned = False
        pending = list(starts)
        while pending:
            left = max(0.0, deadline - time.monotonic())
            if not warned:
                left = min(left, max(0.0, t0 + self.place_warn_s - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                if time.monotonic() < deadline:  # (not warned yet: the warning's time came)
                    warned = True
                    self._note_where(actors, wheres, 0.0)
                    unplaced = self._unplaced(actors, [a for a, ref in zip(actors, starts) if ref in pending])
                    if unplaced:
                        log.warning("not placed by Ray after %g s (still waiting, up to %g s): %s", self.place_warn_s,
                                    timeout_s, unplaced)
                    continue
                self._note_where(actors, wheres, 1.0)
                late = [(s.role, s.index) for s, ref in zip(specs, starts) if ref in pending]
                unplaced = self._unplaced(actors, [a for a, ref in zip(actors, starts) if ref in pending])
                raise WorkerStartError(f"Ray workers {late} did not start in {timeout_s:g} s"
                                       + (f"; not placed by Ray (no process yet): {unplaced}" if unplaced else ""))
            s = specs[starts.index(ready[0])]
            try:
                ray.get(ready[0], timeout=0)
            except RayError as e:
                log.debug("%s worker %d did not start:\n%s", s.role, s.index, e)
                self._note_where(actors, wheres, 1.0)
                if self._closing:
                    raise WorkerStartError(f"{s.role} worker {s.index}: the launcher shut down while it started") \
                        from None
                raise WorkerStartError(start_error(s.role, s.index, e)) from None
        self._note_where(actors, wheres, 10.0)
        return ray.get(starts, timeout=0)

    def _unplaced(self, actors: list, late: list) -> str:
        """The late actors that never said where they run (Ray has not given them a process): what each asks for,
        and the cluster's resources in all and free ("" when every late one runs, its start still busy)."""
        asks = [f"{rec.name} asks for {rec.opts}" for a in late if (rec := self._actors.get(a)) is not None
                and rec.where is None]
        if not asks:
            return ""
        try:
            have = f"the cluster has {_fmt(ray.cluster_resources())}, free {_fmt(ray.available_resources())}"
        except Exception as e:  # noqa: BLE001  the message without it
            have = f"the cluster's resources unknown ({type(e).__name__}: {e})"
        return "; ".join(asks) + f" ({have})"

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
        """False when Ray says the actor is dead or its ping fails or says no; a ping not answered within timeout_s
        is True (alive as far as Ray knows: the Health probe judges a busy or hung worker) and stays pending, to be
        waited for by the next call rather than sent again (a hung actor's queue does not grow a ping a probe)."""
        ref = self._pings.get(w.handle)
        if ref is None:
            ref = self._pings[w.handle] = w.handle.ping.remote()
        try:
            ok = bool(ray.get(ref, timeout=timeout_s))
        except GetTimeoutError:
            return True
        except RayError as e:
            log.debug("the %s worker %d's ping failed: %s", w.role, w.index, e)
            ok = False
        self._pings.pop(w.handle, None)
        return ok

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
            self._pings.pop(a, None)
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
            return gone_and_cleaned(pid, left)
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
        with self._lock:
            self._closing = True
            actors = list(self._actors)
        try:
            self._stop_all(actors, self.shutdown_grace_s)
        finally:
            self._kill_all(actors)
            self._pings.clear()
            if self._owns_ray:
                ray.shutdown()


def _fmt(resources: dict) -> str:
    """Ray's resources as "CPU 8, GPU 0, ..." (its internal node: and memory keys left out)."""
    keep = {k: v for k, v in resources.items() if not k.startswith("node:") and "memory" not in k}
    keep.setdefault("GPU", 0.0)
    return ", ".join(f"{k} {v:g}" for k, v in sorted(keep.items()))

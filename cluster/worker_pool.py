"""The router's workers: start them, pick one per request, watch them, restart the dead.

A supervisor thread probes every worker each `health_interval_s` (the launcher's liveness check,
then the worker's Health RPC, each bounded). A worker whose process/actor is gone is taken out of
rotation at once; one that is alive but fails its Health probe stays in rotation until it failed
`health_failures` probes in a row (one slow answer under load is no reason to drop a worker). Either
is then stopped and started again (a restarted bridge asks for its old port, so the workers' bridge
address stays valid), and is back in rotation on its first good probe. A request that sees a worker
fail marks it down at once, so no new request is routed there while it restarts. The pool's clients
(the bridge's health probes, every worker call) present the cluster secret the launcher gave the
workers (its token).

start() gives each prefill and decode worker first_health_s (30 s, at most start_timeout_s) to answer its first
Health probe at the address it advertised: it already listens by then, so one that does not answer fails the start,
named with that address (the probe used to be given start_timeout_s, 900 s by default, and an address that reached
nothing that answered held the start that long; one refused failed it with a bare gRPC error).

A restarted prefill worker also asks for its old port: decode workers drop the mapped caches of an exporter
when a new one answers at the same address (kv_bridge/handoff.py CacheImporter), so a new port would keep
each dead prefill process's whole KV cache mapped in every decode worker. A restart that fails is retried
after a backoff doubling per failure (restart_backoff_s .. restart_backoff_max_s); after restart_give_up
failures in a row the slot is marked failed (stats(), failed_count) and left alone: a worker that cannot
start (its checkpoint gone, its GPU lost) is not re-spawned forever. A restart only counts as a success
once the new worker has stayed up `stable_s`: one that starts, then goes down within that time (a crash
loop: a GPU that fails under load, a fault it hits at once) counts as a failed restart (stats()'s
early_crashes), so it backs off and is given up like a worker that cannot start, rather than re-spawned at
once for good. Each restart runs on a thread of its own (at most one per slot): a start takes up to
start_timeout_s, and the supervisor keeps probing the other workers meanwhile (it used to restart inline, so
a second worker that died or hung then stayed in rotation until the first restart ended). Shutdown joins the
supervisor (one bounded probe), stops the launcher's workers, which ends a restart in progress, then joins
the restarts: it never waits out a worker's start.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import grpc

from flashpd.cluster.colocation import check_colocated
from flashpd.cluster.launcher import Launched, Launcher, WorkerSpec, WorkerStartError
from flashpd.cluster.worker_client import WorkerClient
from flashpd.kv_bridge.auth import ClusterSecret, resolve
from flashpd.kv_bridge.client import BridgeClient
from flashpd.kv_bridge.tls import BridgeTls

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Slot:
    role: str
    index: int
    launched: Launched
    client: WorkerClient | BridgeClient
    info: dict = field(default_factory=dict)
    healthy: bool = True
    inflight: int = 0
    failures: int = 0  # failed probes in a row
    restart_failures: int = 0  # failed restarts, and crashes within stable_s of a restart, in a row
    restarted_at: float | None = None  # time.monotonic() its last restart answered; None once stable_s passed
    retry_at: float = 0.0  # time.monotonic() before which no restart is tried (the backoff)
    failed: bool = False  # gave up restarting it: never probed, picked or restarted again
    restarting: bool = False  # a thread of its own restarts (or retires) it: the supervisor leaves it alone meanwhile
    # time.monotonic() before which it is not picked: a prefill worker whose prefill timed out (`suspend`)
    suspended_until: float = 0.0

    @property
    def address(self) -> str:
        return self.launched.address


class WorkerPool:
    """secret: the cluster secret the launcher hands its workers (default: this process's)."""

    restart_backoff_s = 1.0  # wait before retrying a failed restart, doubled per failure in a row ...
    restart_backoff_max_s = 60.0  # ... up to this
    restart_give_up = 5  # failed restarts in a row after which the slot is marked failed
    stable_s = 60.0  # a restarted worker up this long resets its backoff; a crash before then counts as a failure
    stop_join_s = 30.0  # bound on joining the supervisor at shutdown (its calls are bounded well below it)
    # bound on a started worker's first Health answer at start(): it already listens (it printed so), so an answer
    # slower than this means the address it advertised is not the one that reaches it (start_timeout_s, 900 s by
    # default, is for its load and warm-up, which are done by then)
    first_health_s = 30.0

    def __init__(self, cfg, launcher: Launcher, secret: ClusterSecret | None = None) -> None:
        self.cfg = cfg
        self.launcher = launcher
        self.secret = secret
        self.slots: dict[str, list[Slot]] = {"bridge": [], "prefill": [], "decode": []}
        self.restarts: Counter[str] = Counter()
        self.early_crashes: Counter[str] = Counter()  # restarted workers that went down again within stable_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restarters: set[threading.Thread] = set()  # restarts in progress (joined at shutdown)

    # ---- start / stop ---------------------------------------------------------------------------
    def _worker_cfg(self):
        return self.cfg.with_(bridge_address=self.bridge_address)

    @property
    def bridge_address(self) -> str:
        return self.slots["bridge"][0].address

    def _client(self, w: Launched):
        c = self.cfg
        tls = BridgeTls.from_paths(c.tls_cert, c.tls_key, c.tls_ca)  # the bridge's and the workers' alike
        if w.role == "bridge":
            return BridgeClient(w.address, timeout_s=c.health_timeout_s, secret=self.secret, tls=tls)
        return WorkerClient(w.role, w.address, resolve(self.secret).worker_token, tls)

    def start(self) -> None:
        """Bridge first (the others need its address), then every prefill and decode worker at once."""
        t = self.cfg.start_timeout_s
        (bridge,) = self.launcher.start([WorkerSpec("bridge", 0, self.cfg)], t)
        self.slots["bridge"].append(Slot("bridge", 0, bridge, self._client(bridge)))
        wcfg = self._worker_cfg()
        specs = [WorkerSpec("prefill", i, wcfg) for i in range(self.cfg.prefill_workers)] + \
                [WorkerSpec("decode", i, wcfg) for i in range(self.cfg.decode_workers)]
        for w in self.launcher.start(specs, t):
            self.slots[w.role].append(Slot(w.role, w.index, w, self._client(w)))
        check_colocated(self.cfg, bridge, [s.launched for s in self.slots["prefill"] + self.slots["decode"]])
        first = min(t, self.first_health_s)
        for s in self.slots["prefill"] + self.slots["decode"]:
            try:
                s.info = s.client.health(first)
            except Exception as e:  # noqa: BLE001  (grpc.RpcError: refused, timed out, ...) named, and the start fails
                code, details = getattr(e, "code", None), getattr(e, "details", None)
                why = f"{code().name}: {details()}" if callable(code) and callable(details) else \
                    f"{type(e).__name__}: {e}"
                raise WorkerStartError(
                    f"{s.role} worker {s.index} is listening, but did not answer its Health probe within {first:g} s "
                    f"at the address it advertised, {s.address} ({why}): is that address reachable from the router "
                    f"(allow_remote, FLASHPD_ADVERTISE_HOST)?") from e
        for s in self.all():
            log.info("%s worker %d at %s%s", s.role, s.index, s.address,
                     f" (metrics {s.launched.metrics_address})" if s.launched.metrics_address else "")
        self._thread = threading.Thread(target=self._supervise, name="worker-supervisor", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """The supervisor is let finish its probe first (bounded: it never waits on a start), so it never calls
        a launcher already shut down (a Ray call then could start a fresh Ray). A restart in progress waits on a
        worker's start (up to start_timeout_s): the launcher's shutdown ends it, then it is joined."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2 * self.cfg.health_timeout_s + 1)  # alive + Health, each bounded
        try:
            self.launcher.shutdown()
        finally:
            deadline = time.monotonic() + self.stop_join_s
            with self._lock:
                threads = ([self._thread] if self._thread is not None else []) + list(self._restarters)
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    log.error("the worker pool's %s thread did not stop in %g s", t.name, self.stop_join_s)
            for s in self.all():
                s.client.close()

    def all(self) -> list[Slot]:
        return self.slots["bridge"] + self.slots["prefill"] + self.slots["decode"]

    # ---- routing --------------------------------------------------------------------------------
    def pick(self, role: str, exclude: tuple[Slot, ...] = ()) -> Slot | None:
        """The healthy, unsuspended worker of `role` with the fewest requests in flight (None when there is none)."""
        now = time.monotonic()
        with self._lock:
            ok = [s for s in self.slots[role] if s.healthy and s not in exclude and s.suspended_until <= now]
            if not ok:
                return None
            s = min(ok, key=lambda s: (s.inflight, s.index))
            s.inflight += 1
            return s

    def release(self, s: Slot) -> None:
        with self._lock:
            s.inflight -= 1

    def suspend(self, s: Slot, seconds: float, why: str) -> None:
        """Pick no new requests for s for `seconds`: it answers Health, but a call to it timed out (a worker stuck in
        its engine, or queued far behind). Each request sent to it meanwhile would wait out the same timeout; after
        it, the next request tries it again (a worker that stays stuck is restarted by its stall watchdog)."""
        if s.suspended_until <= time.monotonic():
            log.warning("%s worker %d (%s) gets no new requests for %g s: %s", s.role, s.index, s.address, seconds,
                        why)
        s.suspended_until = max(s.suspended_until, time.monotonic() + seconds)

    def suspended_count(self, role: str) -> int:
        """Workers of `role` in rotation but suspended now."""
        now = time.monotonic()
        return sum(s.healthy and s.suspended_until > now for s in self.slots[role])

    def mark_down(self, s: Slot, why: str) -> None:
        if s.healthy:
            log.warning("%s worker %d (%s) marked down: %s", s.role, s.index, s.address, why)
        s.healthy = False
        self._wake.set()

    def healthy_count(self, role: str) -> int:
        return sum(s.healthy for s in self.slots[role])

    def failed_count(self, role: str) -> int:
        """Workers of `role` the pool gave up restarting (they stay down until the service restarts)."""
        return sum(s.failed for s in self.slots[role])

    def stats(self) -> dict[str, dict[str, int]]:
        """Per role: workers, healthy, failed (given up), restarts and early crashes (a restarted worker down
        again within stable_s) so far."""
        return {r: dict(workers=len(ss), healthy=self.healthy_count(r), failed=self.failed_count(r),
                        restarts=self.restarts[r], early_crashes=self.early_crashes[r])
                for r, ss in self.slots.items()}

    # ---- supervision ----------------------------------------------------------------------------
    def _probe(self, s: Slot) -> str:
        """How the probe went: "ok"; "gone" (its process / actor is gone: no point probing again); or "failed"
        (alive, but its Health probe failed or it says it is not serving)."""
        t = self.cfg.health_timeout_s
        if not self.launcher.alive(s.launched, t):
            return "gone"
        try:
            if s.role == "bridge":
                s.client.health(t)
            else:
                info = s.client.health(t)
                if not info["serving"]:
                    return "failed"
                s.info = info
            return "ok"
        except Exception as e:  # noqa: BLE001  any failure to answer (RpcError, BridgeError, ...) is a failed probe
            if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return "ok"  # its server refused for load: alive and busy, never a reason to restart it
            log.info("%s worker %d did not answer its health probe: %s", s.role, s.index, e)
            return "failed"

    def _supervise(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.cfg.health_interval_s)
            self._wake.clear()
            for s in self.all():
                if self._stop.is_set():
                    return
                if s.failed or s.restarting:
                    continue
                try:
                    self._check(s)
                except Exception:  # noqa: BLE001  the supervisor outlives any one worker's trouble
                    if self._stop.is_set():
                        return  # the launcher is being shut down under it
                    log.exception("supervising %s worker %d", s.role, s.index)

    def _check(self, s: Slot) -> None:
        probe = self._probe(s)
        if probe == "ok":
            self._answered(s)
            return
        s.failures = self.cfg.health_failures if probe == "gone" else s.failures + 1
        if s.failures < self.cfg.health_failures:
            return  # alive, a probe unanswered (a slow moment): in rotation until health_failures in a row
        if s.healthy:
            log.warning("%s worker %d (%s) out of rotation: %s", s.role, s.index, s.address,
                        "its process is gone" if probe == "gone" else f"{s.failures} failed health probes in a row")
        s.healthy = False
        if s.restarted_at is not None and not self._stop.is_set():
            self._down_after_restart(s)
        if s.failed and not self._stop.is_set():
            self._in_background(s, self._retire, "retire")  # given up just now: its process may still run
            return
        if s.failed or not self.cfg.restart or self._stop.is_set() or time.monotonic() < s.retry_at:
            return
        self._in_background(s, self._restart_slot, "restart")

    def _in_background(self, s: Slot, fn: Callable[[Slot], None], what: str) -> None:
        """Run fn(s) on a thread of its own that owns the slot meanwhile (the supervisor skips it): a start or a
        stop takes long, and the other workers are probed all the while."""
        s.restarting = True
        t = threading.Thread(target=self._owned, args=(s, fn), name=f"{what}-{s.role}{s.index}", daemon=True)
        with self._lock:
            self._restarters.add(t)
        try:
            t.start()
        except BaseException:
            with self._lock:
                self._restarters.discard(t)
            s.restarting = False
            raise

    def _owned(self, s: Slot, fn: Callable[[Slot], None]) -> None:
        """The body of a slot's thread: fn(s); then the slot is the supervisor's again."""
        try:
            fn(s)
        except Exception:  # noqa: BLE001  the slot stays down; the supervisor tries again after its backoff
            log.exception("supervising %s worker %d", s.role, s.index)
        finally:
            s.restarting = False
            with self._lock:
                self._restarters.discard(threading.current_thread())
            self._wake.set()  # probe it (and the rest) now rather than an interval later

    def _restart_slot(self, s: Slot) -> None:
        """Replace the worker; a failure counts toward giving up, and a given-up worker's process is stopped."""
        ok = self._restart(s)
        if not ok and not self._stop.is_set():
            self._restart_failed(s)
            if s.failed:
                self._retire(s)

    def _retire(self, s: Slot) -> None:
        """A given-up slot's process is stopped (it may have started but never answered, or hung): it is never
        probed, picked or restarted again, and would hold its GPU memory and port until the service stopped."""
        if self._stop.is_set():
            return  # the launcher's shutdown stops it
        try:
            self.launcher.stop(s.launched, 10.0)
        except Exception:  # noqa: BLE001  best effort; the launcher's shutdown stops it at the latest
            log.exception("stopping the given-up %s worker %d", s.role, s.index)

    def _answered(self, s: Slot) -> None:
        """A good probe: back in rotation; a restarted worker up stable_s has its backoff reset."""
        s.failures = 0
        if not s.healthy:
            log.info("%s worker %d answers again", s.role, s.index)
            s.suspended_until = 0.0  # a worker back from down (restarted) starts afresh
        s.healthy = True
        now = time.monotonic()
        if s.restart_failures and s.restarted_at is None:
            s.restarted_at = now  # a restart that looked failed answers after all: its stable period starts now
        if s.restarted_at is not None and now - s.restarted_at >= self.stable_s:
            if s.restart_failures:
                log.info("%s worker %d up %g s since its restart: its restart backoff is reset", s.role, s.index,
                         self.stable_s)
            s.restart_failures, s.restarted_at = 0, None

    def _down_after_restart(self, s: Slot) -> None:
        """Down within stable_s of its restart: that restart did not hold, it counts as a failed one (a worker
        that starts fine then crashes would otherwise be re-spawned at once, forever). Later: a fresh failure."""
        up = time.monotonic() - s.restarted_at
        s.restarted_at = None
        if up >= self.stable_s:
            s.restart_failures = 0
            return
        self.early_crashes[s.role] += 1
        log.warning("%s worker %d went down %.1f s after its restart (within stable_s %g s)", s.role, s.index, up,
                    self.stable_s)
        self._restart_failed(s)

    def _restart_failed(self, s: Slot) -> None:
        """Back off before the next try (a worker that cannot start would otherwise be re-spawned, a whole
        process and model load each time, every health interval for good); give up after restart_give_up."""
        s.restart_failures += 1
        if s.restart_failures >= self.restart_give_up:
            s.failed = True
            log.error("%s worker %d failed to restart %d times in a row: given up, it stays down until the service "
                      "is restarted (the launcher's error is logged above)", s.role, s.index, s.restart_failures)
            return
        wait = min(self.restart_backoff_max_s, self.restart_backoff_s * 2 ** (s.restart_failures - 1))
        s.retry_at = time.monotonic() + wait
        log.warning("%s worker %d: restart %d failed, next try in %g s", s.role, s.index, s.restart_failures, wait)

    def _start_one(self, s: Slot) -> Launched:
        """Bridge and prefill ask for their old port: the bridge so the workers' bridge address stays valid, a
        prefill worker so the decode workers' importers drop the dead one's mapped caches (same address, new
        exporter id). A prefill worker whose old port is taken gets a fresh one."""
        keep = s.role in ("bridge", "prefill")
        port = int(s.address.rsplit(":", 1)[1]) if keep else 0
        cfg = self.cfg if s.role == "bridge" else self._worker_cfg()
        try:
            (w,) = self.launcher.start([WorkerSpec(s.role, s.index, cfg, port)], self.cfg.start_timeout_s)
        except Exception as e:
            if s.role != "prefill" or "could not bind" not in str(e) or self._stop.is_set():
                raise
            log.warning("prefill worker %d cannot have its old port %d back; starting it on a fresh one (the decode "
                        "workers keep the old one's caches mapped)", s.index, port)
            (w,) = self.launcher.start([WorkerSpec(s.role, s.index, cfg, 0)], self.cfg.start_timeout_s)
        return w

    def _answers(self, s: Slot) -> bool:
        """The restarted worker answers its Health RPC within start_timeout_s: short probes, so a shutdown
        stops the wait at once rather than after the whole start timeout."""
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not self._stop.is_set():
            t = min(self.cfg.health_timeout_s, deadline - time.monotonic())
            try:
                s.info = s.client.health(max(t, 0.01))
                return True
            except Exception:  # noqa: BLE001  not up yet; tried again until the deadline
                if time.monotonic() >= deadline:
                    log.exception("the restarted %s worker %d does not answer", s.role, s.index)
                    return False
                self._stop.wait(min(0.2, self.cfg.health_timeout_s))
        return False

    def _restart(self, s: Slot) -> bool:
        """Replace the worker; False when it did not start or answer (the slot stays down)."""
        was = s.address
        log.warning("restarting %s worker %d (was %s)", s.role, s.index, was)
        try:
            self.launcher.stop(s.launched, 10.0)
        except Exception:  # noqa: BLE001  it is being replaced whatever state it is in
            log.exception("stopping the old %s worker %d", s.role, s.index)
        if self._stop.is_set():
            return False  # shut down while the old one stopped: nothing new is started
        try:
            w = self._start_one(s)
        except Exception:  # noqa: BLE001  retried after a backoff; the slot stays down meanwhile
            if not self._stop.is_set():
                log.exception("restarting %s worker %d failed", s.role, s.index)
            return False
        peers = [x.launched for x in self.slots["prefill"] + self.slots["decode"] if x is not s and x.healthy]
        try:  # a worker Ray placed on another host than its same-host transport's peers: a failed restart
            check_colocated(self.cfg, w if s.role == "bridge" else self.slots["bridge"][0].launched,
                            peers + ([w] if s.role != "bridge" else []))
        except WorkerStartError:
            log.exception("restarting %s worker %d", s.role, s.index)
            try:
                self.launcher.stop(w, 10.0)
            except Exception:  # noqa: BLE001  the refusal stands whatever its stop does
                log.exception("stopping the misplaced %s worker %d", s.role, s.index)
            return False
        old = s.client
        s.launched, s.client = w, self._client(w)
        old.close()
        if s.role != "bridge" and not self._answers(s):
            return False
        s.failures, s.healthy, s.restarted_at = 0, True, time.monotonic()
        self.restarts[s.role] += 1
        log.warning("%s worker %d restarted at %s", s.role, s.index, s.address)
        if s.role == "bridge" and s.address != was:  # the workers were started with the old one
            log.error("the bridge came back at %s, not its old address: imports fall back to recompute", s.address)
        return True

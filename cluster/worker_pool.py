"""The router's workers: start them, pick one per request, watch them, restart the dead.

A supervisor thread probes every worker each `health_interval_s` (the launcher's liveness check,
then the worker's Health RPC, each bounded). A worker whose process/actor is gone, or that failed
`health_failures` probes in a row, is stopped and started again (a restarted bridge asks for its
old port, so the workers' bridge address stays valid). A request that sees a worker fail marks
it down at once, so no new request is routed there while it restarts. The pool's clients (the bridge's
health probes, every worker call) present the cluster secret the launcher gave the workers (its token).
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

import grpc

from flashpd.cluster.launcher import Launched, Launcher, WorkerSpec
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
    failures: int = 0

    @property
    def address(self) -> str:
        return self.launched.address


class WorkerPool:
    """secret: the cluster secret the launcher hands its workers (default: this process's)."""

    def __init__(self, cfg, launcher: Launcher, secret: ClusterSecret | None = None) -> None:
        self.cfg = cfg
        self.launcher = launcher
        self.secret = secret
        self.slots: dict[str, list[Slot]] = {"bridge": [], "prefill": [], "decode": []}
        self.restarts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- start / stop ---------------------------------------------------------------------------
    def _worker_cfg(self):
        return self.cfg.with_(bridge_address=self.bridge_address)

    @property
    def bridge_address(self) -> str:
        return self.slots["bridge"][0].address

    def _client(self, w: Launched):
        if w.role == "bridge":
            c = self.cfg
            return BridgeClient(w.address, timeout_s=c.health_timeout_s, secret=self.secret,
                                tls=BridgeTls.from_paths(c.tls_cert, c.tls_key, c.tls_ca))
        return WorkerClient(w.role, w.address, resolve(self.secret).token)

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
        for s in self.slots["prefill"] + self.slots["decode"]:
            s.info = s.client.health(t)
        for s in self.all():
            log.info("%s worker %d at %s%s", s.role, s.index, s.address,
                     f" (metrics {s.launched.metrics_address})" if s.launched.metrics_address else "")
        self._thread = threading.Thread(target=self._supervise, name="worker-supervisor", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.cfg.start_timeout_s + 30)
        for s in self.all():
            s.client.close()
        self.launcher.shutdown()

    def all(self) -> list[Slot]:
        return self.slots["bridge"] + self.slots["prefill"] + self.slots["decode"]

    # ---- routing --------------------------------------------------------------------------------
    def pick(self, role: str, exclude: tuple[Slot, ...] = ()) -> Slot | None:
        """The healthy worker of `role` with the fewest requests in flight (None when there is none)."""
        with self._lock:
            ok = [s for s in self.slots[role] if s.healthy and s not in exclude]
            if not ok:
                return None
            s = min(ok, key=lambda s: (s.inflight, s.index))
            s.inflight += 1
            return s

    def release(self, s: Slot) -> None:
        with self._lock:
            s.inflight -= 1

    def mark_down(self, s: Slot, why: str) -> None:
        if s.healthy:
            log.warning("%s worker %d (%s) marked down: %s", s.role, s.index, s.address, why)
        s.healthy = False
        self._wake.set()

    def healthy_count(self, role: str) -> int:
        return sum(s.healthy for s in self.slots[role])

    # ---- supervision ----------------------------------------------------------------------------
    def _probe(self, s: Slot) -> bool:
        t = self.cfg.health_timeout_s
        if not self.launcher.alive(s.launched, t):
            s.failures = self.cfg.health_failures  # the process / actor is gone: no point probing again
            return False
        try:
            if s.role == "bridge":
                s.client.health(t)
            else:
                info = s.client.health(t)
                if not info["serving"]:
                    return False
                s.info = info
            return True
        except Exception as e:  # noqa: BLE001  any failure to answer (RpcError, BridgeError, ...) is a failed probe
            if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return True  # its server refused for load: alive and busy, never a reason to restart it
            log.info("%s worker %d did not answer its health probe: %s", s.role, s.index, e)
            return False

    def _supervise(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.cfg.health_interval_s)
            self._wake.clear()
            for s in self.all():
                if self._stop.is_set():
                    return
                if self._probe(s):
                    s.failures = 0
                    if not s.healthy:
                        log.info("%s worker %d answers again", s.role, s.index)
                    s.healthy = True
                    continue
                s.failures += 1
                s.healthy = False
                if s.failures >= self.cfg.health_failures and self.cfg.restart:
                    self._restart(s)

    def _restart(self, s: Slot) -> None:
        log.warning("restarting %s worker %d (was %s)", s.role, s.index, s.address)
        try:
            self.launcher.stop(s.launched, 10.0)
        except Exception:  # noqa: BLE001  it is being replaced whatever state it is in
            log.exception("stopping the old %s worker %d", s.role, s.index)
        port = int(s.address.rsplit(":", 1)[1]) if s.role == "bridge" else 0
        cfg = self.cfg if s.role == "bridge" else self._worker_cfg()
        try:
            (w,) = self.launcher.start([WorkerSpec(s.role, s.index, cfg, port)], self.cfg.start_timeout_s)
        except Exception:  # noqa: BLE001  retried at the next round; the slot stays down meanwhile
            log.exception("restarting %s worker %d failed", s.role, s.index)
            return
        old = s.client
        s.launched, s.client = w, self._client(w)
        old.close()
        if s.role != "bridge":
            try:
                s.info = s.client.health(self.cfg.start_timeout_s)
            except Exception:  # noqa: BLE001  the next probe decides
                log.exception("the restarted %s worker %d does not answer yet", s.role, s.index)
                return
        s.failures, s.healthy = 0, True
        self.restarts[s.role] += 1
        log.warning("%s worker %d restarted at %s", s.role, s.index, s.address)
        if s.role == "bridge" and s.address != self.bridge_address:
            log.error("the bridge came back at %s, not its old address: imports fall back to recompute", s.address)

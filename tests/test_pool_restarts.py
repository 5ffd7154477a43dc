"""The worker pool's restarts and the local launcher's shutdown: stopping the service mid-restart returns at
once (not after the start timeout); a restart that keeps failing backs off and is given up (the slot marked
failed, the router still serving), and so does a worker that starts fine but goes down again within stable_s
of each restart (a crash loop), and a given-up worker that still runs is stopped; a restart in progress does not
pause the other workers' probes and restarts; a live worker leaves rotation after health_failures failed probes in a
row, a dead one at once; a restarted prefill worker comes back at its old address, so the decode
worker drops the dead one's mapped caches (kv_transport=device); the launcher's own log directory is removed
by a clean shutdown and kept when a worker failed. The pool's policy runs over a fake launcher (fast,
deterministic); what needs real processes runs them with the fixture pair."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.generation_client import GenerationClient
from flashpd.cluster.launcher import Launched, WorkerSpec, WorkerStartError
from flashpd.cluster.local_launcher import LocalLauncher
from flashpd.cluster.service import start_service
from flashpd.cluster.worker_pool import WorkerPool

from tests._cluster_helpers import dflash_pair, serve_cfg, wait_until  # noqa: F401


# ---- the pool's policy over a fake launcher ------------------------------------------------------------------
class _Client:
    fail = False  # its Health probe fails (a live worker that does not answer)

    def health(self, timeout_s: float) -> dict:
        if self.fail:
            raise RuntimeError("no answer")
        return {"serving": True}

    def close(self) -> None:
        pass


class _Proc:
    def __init__(self, lifetime_s: float | None = None) -> None:
        self.alive = True
        self.dies_at = None if lifetime_s is None else time.monotonic() + lifetime_s


class _FakeLauncher:
    """Starts every worker; `failing[role]` makes later starts of that role raise, `crash_after_s[role]` makes
    them die that long after they started."""
    name = "fake"
    secret = None

    def __init__(self) -> None:
        self.starts: list[tuple[float, WorkerSpec]] = []
        self.failing: dict[str, str] = {}
        self.crash_after_s: dict[str, float] = {}
        self.next_port = 5000

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[Launched]:
        out = []
        for s in specs:
            self.starts.append((time.monotonic(), s))
            why = self.failing.get(s.role)
            if why is not None and (why != "bind" or s.port != 0):
                raise WorkerStartError(f"{s.role} worker {s.index}: could not bind" if why == "bind" else why)
            self.next_port += 1
            out.append(Launched(s.role, s.index, f"127.0.0.1:{s.port or self.next_port}", None,
                                _Proc(self.crash_after_s.get(s.role))))
        return out

    def restarts_of(self, role: str) -> list[tuple[float, WorkerSpec]]:
        return [(t, s) for t, s in self.starts if s.role == role][1:]  # the first is the pool's start

    def alive(self, w: Launched, timeout_s: float) -> bool:
        return w.handle.alive and (w.handle.dies_at is None or time.monotonic() < w.handle.dies_at)

    def stop(self, w: Launched, timeout_s: float = 10.0) -> None:
        w.handle.alive = False

    def shutdown(self) -> None:
        pass


class _Pool(WorkerPool):
    def _client(self, w: Launched):
        return _Client()


def _fake_pool(tmp_path: Path, **kw) -> tuple[_Pool, _FakeLauncher]:
    cfg = ServeConfig(target=str(tmp_path), draft=str(tmp_path), mode="local", health_interval_s=0.02,
                      health_timeout_s=1.0, health_failures=2, start_timeout_s=30.0).with_(**kw)
    launcher = _FakeLauncher()
    pool = _Pool(cfg, launcher)
    pool.start()
    return pool, launcher


def test_a_restart_that_keeps_failing_backs_off_then_is_given_up(tmp_path):
    pool, launcher = _fake_pool(tmp_path)
    pool.restart_backoff_s, pool.restart_give_up = 0.2, 4
    try:
        launcher.failing["prefill"] = "checkpoint gone"
        pool.slots["prefill"][0].launched.handle.alive = False  # the process died
        wait_until(lambda: pool.failed_count("prefill") == 1, "the prefill slot to be given up", timeout_s=30)
        tries = [t for t, _ in launcher.restarts_of("prefill")]
        assert len(tries) == 4, len(tries)
        gaps = [b - a for a, b in zip(tries, tries[1:])]
        assert all(g >= want for g, want in zip(gaps, (0.2, 0.4, 0.8))), gaps  # doubling, not every interval
        time.sleep(1.0)  # 50 health intervals: a given-up slot is never started again
        assert len(launcher.restarts_of("prefill")) == 4
        assert pool.stats()["prefill"] == dict(workers=1, healthy=0, failed=1, restarts=0, early_crashes=0)
        assert pool.pick("prefill") is None  # the router sees no prefill worker (decode-side prefill)
        assert pool._thread.is_alive() and pool.healthy_count("decode") == 1  # the rest is still supervised
    finally:
        pool.shutdown()


def test_a_worker_that_restarts_again_resets_its_backoff_once_it_stayed_up(tmp_path):
    pool, launcher = _fake_pool(tmp_path)
    pool.restart_backoff_s, pool.restart_give_up, pool.stable_s = 0.1, 3, 0.5
    try:
        launcher.failing["decode"] = "not yet"
        slot = pool.slots["decode"][0]
        slot.launched.handle.alive = False
        wait_until(lambda: slot.restart_failures == 2, "two failed restarts", timeout_s=30)
        del launcher.failing["decode"]
        wait_until(lambda: pool.restarts["decode"] == 1 and slot.healthy, "the decode worker to restart", timeout_s=30)
        assert slot.restart_failures == 2  # not until it has stayed up stable_s
        wait_until(lambda: slot.restart_failures == 0, "the backoff to reset after stable_s", timeout_s=30)
        assert not slot.failed and pool.early_crashes["decode"] == 0
        n = len(launcher.restarts_of("decode"))
        slot.launched.handle.alive = False  # a crash after stable_s: restarted at once, no backoff
        wait_until(lambda: pool.restarts["decode"] == 2 and slot.healthy, "the decode worker to restart again",
                   timeout_s=30)
        assert len(launcher.restarts_of("decode")) == n + 1 and slot.restart_failures == 0
    finally:
        pool.shutdown()


def test_a_worker_that_crashes_soon_after_each_restart_backs_off_then_is_given_up(tmp_path):
    """Each restart starts fine, then the worker dies 50 ms later: within stable_s, so each counts as a failed
    restart (it used to reset the backoff: restarted at the minimum delay, forever)."""
    pool, launcher = _fake_pool(tmp_path)
    pool.restart_backoff_s, pool.restart_give_up, pool.stable_s = 0.2, 4, 30.0
    try:
        launcher.crash_after_s["decode"] = 0.05
        pool.slots["decode"][0].launched.handle.alive = False  # its first crash: restarted at once
        wait_until(lambda: pool.failed_count("decode") == 1, "the crash-looping slot to be given up", timeout_s=20)
        tries = [t for t, _ in launcher.restarts_of("decode")]
        assert len(tries) == 4, len(tries)
        gaps = [b - a for a, b in zip(tries, tries[1:])]
        assert all(g >= want for g, want in zip(gaps, (0.2, 0.4, 0.8))), gaps
        time.sleep(0.5)
        assert len(launcher.restarts_of("decode")) == 4
        assert pool.stats()["decode"] == dict(workers=1, healthy=0, failed=1, restarts=4, early_crashes=4)
        assert pool.healthy_count("prefill") == 1 and pool._thread.is_alive()
    finally:
        pool.shutdown()


def test_a_live_worker_leaves_rotation_after_health_failures_failed_probes_a_dead_one_at_once(tmp_path):
    """One failed probe (a slow moment under load) used to take a worker out of rotation. The supervisor is
    idle here (an hour's interval): the probes are made by hand."""
    pool, launcher = _fake_pool(tmp_path, health_failures=3, health_interval_s=3600.0, restart=False)
    s = pool.slots["decode"][0]

    def routed() -> bool:
        got = pool.pick("decode")
        if got is not None:
            pool.release(got)
        return got is s

    try:
        s.client.fail = True
        for _ in range(2):
            pool._check(s)
            assert s.healthy and routed()
        pool._check(s)
        assert not s.healthy and not routed()
        s.client.fail = False
        pool._check(s)
        assert s.healthy and routed()  # one good probe: back in rotation
        s.client.fail = True
        pool._check(s)
        assert s.healthy and routed()  # its count started over
        s.launched.handle.alive = False  # its process died: out at once, no health_failures probes
        pool._check(s)
        assert not s.healthy and not routed()
        assert pool.stats()["decode"]["healthy"] == 0
    finally:
        pool.shutdown()


def test_a_restarted_prefill_worker_asks_for_its_old_port_then_any(tmp_path):
    pool, launcher = _fake_pool(tmp_path)
    try:
        old = pool.slots["prefill"][0].address
        pool.slots["prefill"][0].launched.handle.alive = False
        wait_until(lambda: pool.restarts["prefill"] == 1, "the prefill worker to restart", timeout_s=30)
        assert pool.slots["prefill"][0].address == old
        launcher.failing["prefill"] = "bind"  # its old port taken: a fresh one, in the same restart
        pool.slots["prefill"][0].launched.handle.alive = False
        wait_until(lambda: pool.restarts["prefill"] == 2, "the prefill worker to restart again", timeout_s=30)
        assert pool.slots["prefill"][0].address != old
        assert [s.port for _, s in launcher.restarts_of("prefill")] == [int(old.rsplit(":")[1])] * 2 + [0]
        # down again within stable_s of its restart: one failed restart; its fallback port is no second one
        assert pool.slots["prefill"][0].restart_failures == 1
    finally:
        pool.shutdown()


def test_no_restart_once_stop_is_requested(tmp_path):
    pool, launcher = _fake_pool(tmp_path)
    n = len(launcher.starts)
    pool._stop.set()  # what shutdown() sets first, before a probe may see its workers go
    pool.slots["decode"][0].launched.handle.alive = False
    pool._check(pool.slots["decode"][0])
    pool._check(pool.slots["decode"][0])
    assert len(launcher.starts) == n
    pool.shutdown()


# ---- real processes -------------------------------------------------------------------------------------------
def test_stop_returns_promptly_while_a_restart_waits_for_its_worker(dflash_pair):  # noqa: F811
    """The restarted decode process is SIGSTOPped (a GPU worker warming up for minutes looks the same): the
    service's stop used to wait for its start (start_timeout_s, here 600 s)."""
    svc = start_service(serve_cfg(dflash_pair, "local", start_timeout_s=600.0))
    pool, launcher = svc.pool, svc.pool.launcher
    old = pool.slots["decode"][0].launched.handle.proc.pid
    new: list = []
    try:
        launcher.kill(pool.slots["decode"][0].launched)

        def restarting() -> bool:
            new.extend(c.proc for c in list(launcher._children) if c.spec.role == "decode" and c.proc.pid != old)
            return bool(new)

        wait_until(restarting, "the decode worker's restart to spawn it", every_s=0.01)
        os.kill(new[0].pid, signal.SIGSTOP)
        time.sleep(1.0)  # the supervisor is waiting on it
        stopper = threading.Thread(target=svc.stop, daemon=True)
        stopper.start()
        stopper.join(20)
        assert not stopper.is_alive(), "stop() waited for the restart"
        assert new[0].poll() is not None and all(p.poll() is not None for p in launcher.processes())
    finally:
        for p in new:  # an old-code stop blocked on it: freed, so nothing outlives the test
            if p.poll() is None:
                p.kill()


def _mapped_exporters(pid: int) -> set[str]:
    """The processes whose torch shared-memory segments (torch_<pid>_...) `pid` has mapped: the CPU stand-in of
    a prefill worker's CUDA IPC caches."""
    pids = set()
    for ln in Path(f"/proc/{pid}/maps").read_text().splitlines():
        name = ln.split(None, 5)[-1] if len(ln.split(None, 5)) == 6 else ""
        base = os.path.basename(name)
        if base.startswith("torch_"):
            pids.add(base.split("_")[1])
    return pids


def test_a_restarted_prefill_worker_replaces_its_mapped_caches(dflash_pair):  # noqa: F811
    svc = start_service(serve_cfg(dflash_pair, "local", kv_transport="device"))
    pool = svc.pool
    try:
        dec = pool.slots["decode"][0].launched.handle.proc.pid

        def one(i: int) -> None:
            with GenerationClient(svc.address, timeout_s=60) as c:
                c.generate_once([(i * 13 + j) % 120 + 1 for j in range(50)], max_tokens=4, method="native",
                                ignore_eos=True)

        one(0)
        first = str(pool.slots["prefill"][0].launched.handle.proc.pid)
        assert _mapped_exporters(dec) == {first}
        address = pool.slots["prefill"][0].address
        assert list(Path("/dev/shm").glob(f"torch_{first}_*"))  # its caches, shared by file name
        pool.launcher.kill(pool.slots["prefill"][0].launched)
        wait_until(lambda: pool.restarts["prefill"] == 1 and pool.healthy_count("prefill") == 1,
                   "the prefill worker to restart", timeout_s=60)
        assert pool.slots["prefill"][0].address == address
        one(1)
        second = str(pool.slots["prefill"][0].launched.handle.proc.pid)
        assert _mapped_exporters(dec) == {second}, "the dead prefill worker's caches are still mapped"
        # and their files are gone: the decode worker's connection to the dead worker's torch_shm_manager kept
        # them in /dev/shm (a whole KV cache a crash) until the decode worker exited
        assert not list(Path("/dev/shm").glob(f"torch_{first}_*"))
    finally:
        svc.stop()


def _bridge_spec(pair) -> WorkerSpec:
    return WorkerSpec("bridge", 0, serve_cfg(pair, "local"))


def test_a_clean_shutdown_removes_the_launchers_log_dir(dflash_pair):  # noqa: F811
    launcher = LocalLauncher()
    (w,) = launcher.start([_bridge_spec(dflash_pair)], 60)
    assert launcher.alive(w, 1.0) and any(launcher.log_dir.iterdir())
    launcher.shutdown()
    assert not launcher.log_dir.exists()


def test_a_given_log_dir_is_kept(dflash_pair, tmp_path):  # noqa: F811
    launcher = LocalLauncher(tmp_path / "logs")
    launcher.start([_bridge_spec(dflash_pair)], 60)
    launcher.shutdown()
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["bridge0-1.log"]


def test_the_log_dir_of_a_failed_worker_is_kept_and_named(dflash_pair, tmp_path, caplog):  # noqa: F811
    launcher = LocalLauncher()
    bad = WorkerSpec("prefill", 0, serve_cfg(dflash_pair, "local", target=str(tmp_path / "gone"),
                                             bridge_address="127.0.0.1:1"))
    try:
        try:
            launcher.start([bad], 60)
            raise AssertionError("a worker without a checkpoint started")
        except WorkerStartError:
            pass
        with caplog.at_level("WARNING", logger="flashpd.cluster.local_launcher"):
            launcher.shutdown()
        assert (launcher.log_dir / "prefill0-1.log").exists()
        assert str(launcher.log_dir) in caplog.text and "prefill0-1.log" in caplog.text
    finally:
        import shutil  # noqa: PLC0415
        shutil.rmtree(launcher.log_dir, ignore_errors=True)


def test_a_bridge_back_at_another_address_is_reported(tmp_path, caplog):
    """The workers were started with the bridge's old address: a bridge restarted elsewhere costs every import
    (recomputed), which the pool must say (its check compared the slot's address with itself)."""
    import logging

    pool, launcher = _fake_pool(tmp_path)
    real = launcher.start

    def elsewhere(specs, timeout_s):  # its old port not honoured
        return real([WorkerSpec(s.role, s.index, s.cfg, 0) for s in specs], timeout_s)

    launcher.start = elsewhere
    try:
        with caplog.at_level(logging.ERROR, logger="flashpd.cluster.worker_pool"):
            pool.slots["bridge"][0].launched.handle.alive = False
            wait_until(lambda: pool.restarts["bridge"] == 1, "the bridge to restart", timeout_s=30)
        assert "the bridge came back at" in caplog.text
    finally:
        pool.shutdown()


def test_a_restart_in_progress_does_not_pause_the_other_workers_supervision(tmp_path):
    """A restart waits for its worker's start (up to start_timeout_s, 900 s by default: a GPU worker compiles and
    captures its graphs). The supervisor used to restart inline, so meanwhile no other worker was probed: one that
    died (or hung) stayed in rotation, and was restarted only after the first restart ended."""
    pool, launcher = _fake_pool(tmp_path)
    entered = {"prefill": threading.Event(), "decode": threading.Event()}
    gate = {"prefill": threading.Event(), "decode": threading.Event()}
    real = launcher.start

    def slow(specs, timeout_s):  # each restart's start waits for its gate (a long start)
        role = specs[0].role
        if role in gate:
            entered[role].set()
            gate[role].wait(30)
        return real(specs, timeout_s)

    launcher.start = slow
    try:
        pool.slots["prefill"][0].launched.handle.alive = False
        assert entered["prefill"].wait(10), "the prefill worker's restart did not begin"
        dec = pool.slots["decode"][0]
        dec.launched.handle.alive = False  # dies while the prefill worker is still starting
        wait_until(lambda: not dec.healthy, "the dead decode worker to leave rotation", timeout_s=5)
        assert pool.pick("decode") is None
        assert entered["decode"].wait(5), "the decode worker's restart did not begin"
        gate["decode"].set()
        wait_until(lambda: pool.restarts["decode"] == 1 and dec.healthy, "the decode worker's restart", timeout_s=5)
        assert pool.restarts["prefill"] == 0  # still starting
        gate["prefill"].set()
        wait_until(lambda: pool.restarts["prefill"] == 1 and pool.slots["prefill"][0].healthy,
                   "the prefill worker's restart", timeout_s=10)
    finally:
        for g in gate.values():
            g.set()
        pool.shutdown()


def test_a_given_up_worker_that_still_runs_is_stopped(tmp_path):
    """Every restarted decode worker starts but never answers its Health probe (hung in its start: a stuck CUDA or
    NCCL init). The slot is given up; its last process, alive and holding its GPU memory and port, used to be left
    running until the service stopped."""

    class _Hung(_Pool):
        def _client(self, w: Launched):
            c = _Client()
            c.fail = w.role == "decode" and len(launcher.restarts_of("decode")) > 0  # each restarted one hangs
            return c

    cfg = ServeConfig(target=str(tmp_path), draft=str(tmp_path), mode="local", health_interval_s=0.02,
                      health_timeout_s=0.05, health_failures=2, start_timeout_s=0.2)
    launcher = _FakeLauncher()
    pool = _Hung(cfg, launcher)
    pool.start()
    pool.restart_backoff_s, pool.restart_give_up = 0.05, 2
    try:
        pool.slots["decode"][0].launched.handle.alive = False
        wait_until(lambda: pool.failed_count("decode") == 1, "the decode slot to be given up", timeout_s=20)
        last = pool.slots["decode"][0].launched
        assert len(launcher.restarts_of("decode")) == 2
        wait_until(lambda: not last.handle.alive, "the given-up worker's process to be stopped", timeout_s=5)
    finally:
        pool.shutdown()


# ---- the first Health probe at start: bounded, and named -------------------------------------------------------
class _AddressedLauncher(_FakeLauncher):
    """Starts every worker at once; a prefill worker advertises `prefill_address` (the bridge: nothing is called)."""

    def __init__(self, prefill_address: str) -> None:
        super().__init__()
        self.prefill_address = prefill_address

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[Launched]:
        out = super().start(specs, timeout_s)
        for w in out:
            if w.role == "prefill":
                w.address = self.prefill_address
        return out


class _NeverAnswers(grpc.GenericRpcHandler):
    """Something listening at the advertised address that takes every call and answers none (until `release`): an
    address that is not the worker's (another process's port, a proxy that holds calls)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def service(self, details):
        def handler(request, context):
            self.release.wait(120)
            context.abort(grpc.StatusCode.UNAVAILABLE, "released by the test")

        return grpc.unary_unary_rpc_method_handler(handler)


@pytest.fixture
def advertised(request):
    """The address a worker advertised, and what is there: `never_answers` (a server that takes every call and answers
    none), `silent` (a socket that accepts connections and never speaks: a host that drops what it gets looks the
    same to gRPC) or `refused` (nothing listens)."""
    release = threading.Event()
    server = sock = None
    if request.param == "never_answers":
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((_NeverAnswers(release),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
    else:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        if request.param == "silent":
            sock.listen(8)
        # "refused": bound, never listening, so connections are refused and no other test's server can take the
        # port (closed, another xdist process's port-0 bind could land on it)
    yield f"127.0.0.1:{port}"
    release.set()
    if server is not None:
        server.stop(None)
    if sock is not None:
        sock.close()


@pytest.mark.parametrize("advertised", ["never_answers", "silent", "refused"], indirect=True)
def test_a_worker_whose_advertised_address_does_not_answer_fails_the_start_soon_by_name(tmp_path, advertised):
    """start_timeout_s is 900 s (a worker's load and warm-up); the workers already listen when their first Health
    probe goes out, so a probe not answered within first_health_s fails the start, naming the worker and the
    address it advertised. The probe was given the whole start timeout: a server that never answers held the start
    that long, a silent socket until gRPC's own connect timeout (20 s), and either, like a refused connection, then
    failed it with a bare gRPC error that named neither the worker nor the address."""
    cfg = ServeConfig(target=str(tmp_path), draft=str(tmp_path), mode="local", health_interval_s=0.05,
                      health_timeout_s=1.0, start_timeout_s=900.0)
    pool = WorkerPool(cfg, _AddressedLauncher(advertised))
    pool.first_health_s = 1.0
    out: dict = {}

    def start() -> None:
        t0 = time.monotonic()
        try:
            pool.start()
        except Exception as e:  # noqa: BLE001
            out["error"] = e
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=start, daemon=True)
    try:
        t.start()
        t.join(15.0)
        assert not t.is_alive(), "the start still waits on the worker's first Health probe"
        err = out.get("error")
        assert isinstance(err, WorkerStartError), repr(err)
        assert f"prefill worker 0 is listening, but did not answer its Health probe within 1 s at the address it " \
               f"advertised, {advertised}" in str(err), str(err)
        assert out["s"] < 10, out
    finally:
        pool.shutdown()
        t.join(30.0)  # (old code: released by the fixture's teardown, or gRPC's connect timeout)

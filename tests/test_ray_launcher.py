"""The Ray launcher's stop, shutdown and failed start on a real local Ray cluster, with a stand-in worker (a
listening socket, no model) where the worker's own behaviour is the point: a shutdown asks each worker to stop
gracefully before it kills the actor (a bridge's queued disk writes finish); a worker stuck in its stop is
killed after the grace, and the stop returns only once its process has exited (ray.kill returns at once), so a
new worker can have its port straight away; a worker whose start fails (a bad checkpoint config) is reported in
one line with the original exception, its remote traceback only in the debug log. A start after shutdown is refused
(a restart racing the shutdown left an actor nobody killed); a worker slow to answer its ping is alive (the Health
probe judges it; a timeout used to count as dead, restarting a busy worker at once) and is not pinged again while a
ping is pending; a worker Ray cannot place is reported with what it asks for and what the cluster has."""
from __future__ import annotations

import logging
import socket
import sys
import time
from pathlib import Path

import pytest

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.launcher import WorkerSpec, WorkerStartError
from flashpd.cluster.worker_main import RunningWorker

from tests._cluster_helpers import ray_cluster  # noqa: F401

ray = pytest.importorskip("ray")
from flashpd.cluster.ray_actors import WorkerActor  # noqa: E402  (needs ray)
from flashpd.cluster.ray_launcher import RayLauncher  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors below: Ray's workers cannot import tests/


class _Worker(WorkerActor):
    """Listens on its port; its stop takes stop_s (a bridge draining its disk queue), then marks the config's
    target directory and closes the socket."""
    stop_s = 0.5

    def _build(self, role, cfg, port, secret) -> RunningWorker:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()

        def drain() -> None:
            time.sleep(self.stop_s)
            (Path(cfg.target) / f"{role}-stopped").write_text("drained")
            sock.close()

        return RunningWorker(role, f"127.0.0.1:{sock.getsockname()[1]}", closers=[drain])


class _Stuck(_Worker):
    stop_s = 3600.0  # its stop never returns: killed after the grace, the socket held to its process's end


def _launcher(actor) -> RayLauncher:
    launcher = RayLauncher()
    launcher.actor_cls = ray.remote(max_restarts=0)(actor)
    return launcher


def _spec(tmp_path: Path, port: int = 0) -> WorkerSpec:
    return WorkerSpec("bridge", 0, ServeConfig(target=str(tmp_path), draft=None, mode="ray", device="cpu"), port)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_shutdown_stops_each_worker_gracefully_before_killing_it(ray_cluster, tmp_path):  # noqa: F811
    launcher = _launcher(_Worker)
    (w,) = launcher.start([_spec(tmp_path)], 60)
    launcher.shutdown()
    mark = tmp_path / "bridge-stopped"
    assert mark.exists() and mark.read_text() == "drained", "killed before its graceful stop"
    assert not launcher.alive(w, 5.0)


@pytest.mark.parametrize("here", [True, False], ids=["this-node", "other-node"])
def test_a_stuck_worker_is_killed_and_its_port_is_free_when_stop_returns(ray_cluster, tmp_path, here):  # noqa: F811
    """other-node: the launcher takes the actor for one of another host's, whose process it waits for through a
    task on that node."""
    launcher = _launcher(_Stuck)
    launcher.shutdown_grace_s = 0.5
    if not here:
        launcher._node = "another node"
    try:
        (w,) = launcher.start([_spec(tmp_path)], 60)
        port = int(w.address.rsplit(":", 1)[1])
        t0 = time.monotonic()
        launcher.stop(w, 0.5)  # what the pool's restart does first
        # bounded: the graceful stop's 0.5 s, exit_wait_s for the process (another node's: a task there, whose
        # result is awaited 5 s longer), and slack for Ray's scheduling on a loaded 2-core machine
        assert time.monotonic() - t0 < 0.5 + launcher.exit_wait_s + 5.0 + 10.0
        assert _port_free(port), "stop returned while the killed actor's process still held its port"
        (again,) = launcher.start([_spec(tmp_path, port)], 60)  # the restart, on the old port
        assert again.address == w.address
    finally:
        launcher.shutdown()
    assert _port_free(port)


def test_a_worker_that_fails_to_start_is_reported_in_one_line(ray_cluster, tmp_path, caplog):  # noqa: F811
    (tmp_path / "config.json").write_text("[1]")  # the bridge reads the checkpoint's config: a CheckpointError
    launcher = RayLauncher()
    try:
        with caplog.at_level(logging.DEBUG, logger="flashpd.cluster.ray_launcher"):
            with pytest.raises(WorkerStartError) as ei:
                launcher.start([_spec(tmp_path)], 60)
    finally:
        launcher.shutdown()
    assert str(ei.value) == (f"bridge worker 0 did not start: CheckpointError: {tmp_path}/config.json: must hold a "
                             "JSON object, got list")
    assert ei.value.__cause__ is None and ei.value.__suppress_context__  # no remote traceback chained to it
    assert "in read_json_object" in caplog.text  # its remote traceback: in the debug log
    assert not launcher._actors


def test_a_start_after_shutdown_is_refused_and_leaves_no_actor(ray_cluster, tmp_path):  # noqa: F811
    """What a restart racing the service's shutdown does: the launcher's shutdown has listed and killed its actors,
    then the restart's start comes. It used to create a worker that nothing would ever stop."""
    launcher = _launcher(_Worker)
    launcher.shutdown()
    started = []
    try:
        with pytest.raises(WorkerStartError, match="shut down"):
            started = launcher.start([_spec(tmp_path)], 60)
    finally:
        for w in started:  # old code: the leaked worker, killed so that nothing outlives the test
            ray.kill(w.handle, no_restart=True)
    assert not launcher._actors


class _SlowPing(_Worker):
    """Its first ping takes 3 s (an interpreter busy with the engine, a GIL held): alive, just slow."""
    pings = 0

    def ping(self) -> bool:
        self.pings += 1
        if self.pings == 1:
            time.sleep(3.0)
        return True

    def count(self) -> int:
        return self.pings


def test_a_worker_slow_to_answer_its_ping_is_alive_and_pinged_once(ray_cluster, tmp_path):  # noqa: F811
    launcher = _launcher(_SlowPing)
    try:
        (w,) = launcher.start([_spec(tmp_path)], 60)
        for _ in range(3):  # three probes while its first ping is unanswered
            assert launcher.alive(w, 0.3), "a ping not answered in time was taken for a dead worker"
        assert launcher.alive(w, 30.0)  # the pending ping's answer
        assert ray.get(w.handle.count.remote(), timeout=30) == 1, "a ping sent again while one was pending"
        launcher.kill(w)
        assert not launcher.alive(w, 10.0)  # dead is still dead
        assert not launcher._pings
    finally:
        launcher.shutdown()


def test_a_worker_ray_cannot_place_is_named_with_what_it_asks_for(ray_cluster, tmp_path, caplog):  # noqa: F811
    """A GPU share on a cluster without GPUs: the start used to wait out its timeout (900 s by default), then say
    only that the worker "did not start". Now: logged once place_warn_s passes, and named in the error."""
    launcher = _launcher(_Worker)
    launcher.place_warn_s = 1.0
    spec = WorkerSpec("prefill", 0, ServeConfig(target=str(tmp_path), draft=None, mode="ray", num_gpus=1.0))
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="flashpd.cluster.ray_launcher"):
            with pytest.raises(WorkerStartError) as ei:
                launcher.start([spec], 4.0)
    finally:
        launcher.shutdown()
    msg = str(ei.value)
    assert msg.startswith("Ray workers [('prefill', 0)] did not start in 4 s; not placed by Ray"), msg
    assert "prefill worker 0 asks for {'num_cpus': 1, 'num_gpus': 1.0}" in msg and "GPU 0" in msg, msg
    assert "not placed by Ray after 1 s" in caplog.text and "prefill worker 0 asks for" in caplog.text
    assert time.monotonic() - t0 < 4.0 + launcher.exit_wait_s + 10.0
    assert not launcher._actors


def test_an_actor_gets_the_config_paths_made_absolute(ray_cluster, tmp_path, monkeypatch):  # noqa: F811
    """Paths in a serve config are relative to where `flashpd serve` runs; an actor resolved them where its Ray
    worker runs (`ray start`'s directory), so a relative target was "no config.json" there."""
    monkeypatch.chdir(tmp_path.parent)
    spec = WorkerSpec("bridge", 0, ServeConfig(target=tmp_path.name, draft=None, mode="ray", device="cpu"), 0)
    launcher = _launcher(_Worker)
    launcher.start([spec], 60)
    launcher.shutdown()
    assert (tmp_path / "bridge-stopped").read_text() == "drained"  # the stand-in wrote under cfg.target


def test_starting_ray_keeps_the_serve_sigterm_handler(monkeypatch):
    """ray.init installs its own SIGTERM handler (Ray 2.60 does, in the driver): a SIGTERM while `flashpd serve`
    started its workers then killed the process without the start's cleanup (the prefill worker's shared-memory
    files stayed in /dev/shm). The launcher puts the serve's handler back; ray.init stands in here as Ray's does."""
    import signal

    def mine(*_):
        pass

    def rays(*_):
        pass

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: signal.signal(signal.SIGTERM, rays))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Ctx", (), {"get_node_id": lambda self: "n"})())
    old = signal.signal(signal.SIGTERM, mine)
    try:
        RayLauncher()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)

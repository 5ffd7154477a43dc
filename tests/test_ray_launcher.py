"""The Ray launcher's stop, shutdown and failed start on a real local Ray cluster, with a stand-in worker (a
listening socket, no model) where the worker's own behaviour is the point: a shutdown asks each worker to stop
gracefully before it kills the actor (a bridge's queued disk writes finish); a worker stuck in its stop is
killed after the grace, and the stop returns only once its process has exited (ray.kill returns at once), so a
new worker can have its port straight away; a worker whose start fails (a bad checkpoint config) is reported in
one line with the original exception, its remote traceback only in the debug log."""
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

"""Same-host transports checked at start (cluster/colocation.py): shm and arena need the bridge and every worker on
one host, kv_transport device every prefill and decode worker; a start or restart that spans hosts is refused by
name. Ray placed such workers anywhere before, and each request then failed its publish or import and recomputed.
The pool's check runs over the fake launcher of test_pool_restarts; host identities are real processes'."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashpd.cluster.colocation import check_colocated, host_identity
from flashpd.cluster.config import ServeConfig
from flashpd.cluster.launcher import Launched, WorkerSpec, WorkerStartError

from tests._cluster_helpers import wait_until
from tests.test_pool_restarts import _FakeLauncher, _Pool

HERE = host_identity()
THERE = {"key": "0123456789abcdef", "host": "other-host", "node": "5f61aa00bb11cc22"}


def _cfg(tmp_path: Path, **kw) -> ServeConfig:
    return ServeConfig(target=str(tmp_path), draft=str(tmp_path), mode="local", health_interval_s=0.02,
                       health_timeout_s=1.0, health_failures=2, start_timeout_s=30.0).with_(**kw)


def _w(role: str, index: int, host: dict | None) -> Launched:
    return Launched(role, index, f"127.0.0.1:{5000 + index}", None, None, host)


@pytest.mark.parametrize("kw, bridge_elsewhere_refused, split_workers_refused", [
    (dict(bridge_transport="shm"), True, True),
    (dict(bridge_transport="arena"), True, True),
    (dict(bridge_transport="inline", kv_transport="device"), False, True),
    (dict(bridge_transport="shm", kv_transport="dist"), True, True),  # the prefix cache still reads through it
    (dict(bridge_transport="inline"), False, False),
    (dict(bridge_transport="inline", kv_transport="dist"), False, False),
    (dict(bridge_transport="inline", kv_transport="device", prefill_workers=0), False, False),  # nothing handed over
])
def test_which_placements_are_refused(tmp_path, kw, bridge_elsewhere_refused, split_workers_refused):
    cfg = _cfg(tmp_path, **kw)
    here = [_w("prefill", 0, HERE), _w("decode", 0, HERE), _w("decode", 1, HERE)]
    check_colocated(cfg, _w("bridge", 0, HERE), here)  # one host: always fine
    check_colocated(cfg, _w("bridge", 0, HERE), here + [_w("decode", 2, None)])  # unknown: not checked
    cases = {"bridge elsewhere": (_w("bridge", 0, THERE), here, bridge_elsewhere_refused),
             "a decode worker elsewhere": (_w("bridge", 0, HERE), here[:2] + [_w("decode", 1, THERE)],
                                           split_workers_refused)}
    for name, (bridge, workers, refused) in cases.items():
        if not refused:
            check_colocated(cfg, bridge, workers)
            continue
        with pytest.raises(WorkerStartError) as e:
            check_colocated(cfg, bridge, workers)
        msg = str(e.value)
        assert "other-host" in msg and "Ray node 5f61aa00bb11" in msg and HERE["host"] in msg, (name, msg)
        assert ("bridge_transport" in msg) if kw["bridge_transport"] != "inline" else ("kv_transport 'device'" in msg)


def test_processes_of_this_host_share_its_identity():
    out = subprocess.run([sys.executable, "-c", "from flashpd.cluster.colocation import host_identity as h; "
                          "print(h()['key'])"], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == HERE["key"]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_a_process_with_its_own_dev_shm_is_another_host():
    """A container on this kernel with a /dev/shm of its own (its segments invisible here) is not this host."""
    script = ("mount -t tmpfs tmpfs /dev/shm && exec " + sys.executable + " -c \"from flashpd.cluster.colocation "
              "import host_identity as h; print(h()['key'])\"")
    out = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"no user and mount namespace here: {out.stderr.strip()[:200]}")
    assert out.stdout.strip() and out.stdout.strip() != HERE["key"]


class _HostLauncher(_FakeLauncher):
    """The fake launcher, giving each started worker the host `hosts[role]` names (default: this one)."""

    def __init__(self) -> None:
        super().__init__()
        self.hosts: dict[str, dict] = {}

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[Launched]:
        out = super().start(specs, timeout_s)
        for w in out:
            w.host = self.hosts.get(w.role, HERE)
        return out


def test_a_service_start_that_spans_hosts_is_refused(tmp_path):
    launcher = _HostLauncher()
    launcher.hosts["decode"] = THERE
    pool = _Pool(_cfg(tmp_path, bridge_transport="arena"), launcher)
    try:
        with pytest.raises(WorkerStartError, match="bridge_transport 'arena' needs the bridge and every prefill"):
            pool.start()
    finally:
        pool.shutdown()


def test_a_restart_onto_another_host_is_a_failed_restart(tmp_path):
    launcher = _HostLauncher()
    pool = _Pool(_cfg(tmp_path, kv_transport="device"), launcher)
    pool.restart_backoff_s, pool.restart_give_up = 0.05, 2
    pool.start()
    try:
        launcher.hosts["decode"] = THERE  # Ray puts the replacement on another node
        slot = pool.slots["decode"][0]
        slot.launched.handle.alive = False
        wait_until(lambda: pool.failed_count("decode") == 1, "the decode slot to be given up", timeout_s=30)
        assert len(launcher.restarts_of("decode")) == 2 and not slot.healthy
        assert slot.launched.host == HERE  # the misplaced replacement never took the slot
        launcher.hosts.pop("decode")
    finally:
        pool.shutdown()

"""A colocated service whose engine step hangs (a kernel that never returns) says so: gRPC Health and HTTP /health
report not serving once the loop has held requests for stall_s without finishing a step, and serving again once it
steps. Only the disaggregated decode worker did before; colocated, in process or in an engine process, Health said
serving for as long as the step hung."""
from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.generation_client import GenerationClient
from flashpd.cluster.service import start_service
from flashpd.decode_node.scheduler import Scheduler
from tests._cluster_helpers import wait_until

DEMO = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"
HANG_S = 40.0
STALL_S = 1.0

# The engine process's hang: a sitecustomize on its PYTHONPATH (this test's only) holds every step while a file is
# there; the serving code has no hook for it.
_SITECUSTOMIZE = '''
import os, time
_gate = os.environ.get("FLASHPD_TEST_HANG_WHILE")
if _gate:
    from flashpd.decode_node.scheduler import Scheduler
    _step = Scheduler.step
    def step(self):
        t0 = time.monotonic()
        while os.path.exists(_gate) and time.monotonic() - t0 < %r:
            time.sleep(0.02)
        return _step(self)
    Scheduler.step = step
''' % HANG_S


def _cfg(**kw) -> ServeConfig:
    return ServeConfig(target=str(DEMO / "target"), draft=str(DEMO / "drafter"), device="cpu", dtype="float32",
                       kv_cache_tokens=2048, torch_threads=1, stall_s=STALL_S, prefill_timeout_s=0.25, http_port=0,
                       **kw)


def _http_health(svc) -> int:
    try:
        with urllib.request.urlopen(f"http://{svc.http_address}/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _hang_and_recover(svc, hold, release) -> None:
    client = GenerationClient(svc.address, timeout_s=HANG_S + 30.0)
    out: dict = {}

    def run() -> None:
        try:
            out["r"] = client.generate_once([5, 17, 300, 41, 9, 77], max_tokens=4, method="native", ignore_eos=True)
        except Exception as e:  # noqa: BLE001  reported below
            out["error"] = e

    try:
        assert client.health()["serving"] and _http_health(svc) == 200
        hold()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t0 = time.monotonic()
        wait_until(lambda: not client.health()["serving"], "Health to say the hung engine is not serving",
                   timeout_s=HANG_S - 10.0, every_s=0.1)
        assert time.monotonic() - t0 >= STALL_S - 0.2 and _http_health(svc) == 503
        release()  # the step returns: the request finishes and the service serves again
        t.join(60.0)
        assert "error" not in out and len(out["r"].token_ids) == 4, out
        wait_until(lambda: client.health()["serving"] and _http_health(svc) == 200, "serving again once it steps",
                   timeout_s=30.0, every_s=0.1)
    finally:
        release()
        client.close()


def test_colocated_in_process_says_not_serving_while_a_step_hangs(monkeypatch):
    gate = threading.Event()
    real_step = Scheduler.step

    def step(self):  # does not return (a kernel that never ends) until the gate opens
        gate.wait(HANG_S)
        return real_step(self)

    svc = start_service(_cfg(engine_process=False))
    try:
        monkeypatch.setattr(Scheduler, "step", step)
        _hang_and_recover(svc, gate.clear, gate.set)
    finally:
        gate.set()
        svc.stop()


def test_colocated_engine_process_says_not_serving_while_a_step_hangs(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    flag = tmp_path / "hang"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FLASHPD_TEST_HANG_WHILE", str(flag))
    svc = start_service(_cfg(engine_process=True))
    try:
        assert svc.worker is None  # the engine runs in its own process
        _hang_and_recover(svc, flag.touch, lambda: flag.unlink(missing_ok=True))
    finally:
        flag.unlink(missing_ok=True)
        svc.stop()


def test_a_probe_after_a_long_idle_spell_does_not_take_a_healthy_step_for_hung(monkeypatch):
    """The stall clock is the running pass's own: idle for longer than stall_s with no probe, then a request whose
    steps each take well under stall_s, is serving throughout (the clock once started at the last probe, which had
    seen the service idle, and so counted the idle spell)."""
    real_step = Scheduler.step
    stepping = threading.Event()

    def step(self):
        stepping.set()
        time.sleep(0.4 * STALL_S)
        return real_step(self)

    svc = start_service(_cfg(engine_process=False))
    client = GenerationClient(svc.address, timeout_s=60.0)
    try:
        assert client.health()["serving"]
        monkeypatch.setattr(Scheduler, "step", step)
        time.sleep(1.5 * STALL_S)  # idle, unprobed
        t = threading.Thread(target=lambda: client.generate_once([5, 17, 300], max_tokens=3, method="native",
                                                                 ignore_eos=True), daemon=True)
        t.start()
        assert stepping.wait(30.0)
        seen = []
        while t.is_alive():
            seen.append(client.health()["serving"] and _http_health(svc) == 200)
            time.sleep(0.05)
        assert seen and all(seen), seen
    finally:
        client.close()
        svc.stop()

"""The service disaggregated on the local launcher (plain processes, no Ray): (c) equals (a)
colocated token for token and step for step; a killed prefill process falls back to decode-side
recompute (exact, counted) and is restarted; a killed decode process fails its request with
UNAVAILABLE (nothing to retry on), is restarted, and the service serves again; a dead bridge costs one
request's publish (recomputed, exact) and never marks the prefill worker down; `flashpd serve
--config` with a YAML file (worker warm-up on) starts the same service."""
from __future__ import annotations

import json
import threading

import grpc
import pytest

from flashpd.cluster.generation_client import GenerationClient, GenerationUnavailable
from flashpd.cluster.service import start_service

from tests._serve_process import serve_process
from tests._cluster_helpers import (N_PROMPTS, colocated_reference, dflash_pair, request_kw,  # noqa: F401
                                    run_concurrently, serve_cfg, stream, wait_until)


@pytest.fixture(scope="module")
def service(dflash_pair):  # noqa: F811
    svc = start_service(serve_cfg(dflash_pair, "local", prefill_workers=1, decode_workers=1))
    yield svc
    procs = svc.pool.launcher.processes()
    assert len(procs) == 3  # bridge, prefill, decode (the killed ones replaced)
    svc.stop()
    assert all(p.poll() is not None for p in procs), "a worker outlived the service"


def test_local_disaggregated_equals_colocated(service, colocated_reference):
    ps, ref = colocated_reference
    got = run_concurrently(service.address, list(range(N_PROMPTS)), ps)
    for i in range(N_PROMPTS):
        assert got[i] == ref[i], f"request {i}: tokens / acceptance lengths differ from colocated"
    assert sum(service.backend.fallbacks.values()) == 0  # every publish after its answer awaited, none failed
    with pytest.raises(grpc.RpcError) as e:  # the prefill worker's AwaitPublish: a ticket it never issued
        service.pool.slots["prefill"][0].client.await_publish_future(12345, 10).result()
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_killed_prefill_process_falls_back_exactly_and_is_restarted(service, colocated_reference):
    ps, ref = colocated_reference
    router, pool = service.backend, service.pool
    pool.launcher.kill(pool.slots["prefill"][0].launched)  # SIGKILL
    with GenerationClient(service.address, timeout_s=60) as c:
        got = stream(c, ps[1], **request_kw(1))
    assert (got[0], got[1]["acceptance_lengths"]) == ref[1]
    assert sum(router.fallbacks.values()) == 1  # refused by the dead worker, or none was healthy: either is counted
    wait_until(lambda: pool.restarts["prefill"] == 1 and pool.healthy_count("prefill") == 1,
               "the prefill process to be restarted", timeout_s=120)
    with GenerationClient(service.address, timeout_s=60) as c:
        got = stream(c, ps[2], **request_kw(2))
    assert (got[0], got[1]["acceptance_lengths"]) == ref[2]
    assert sum(router.fallbacks.values()) == 1


def test_killed_decode_process_fails_its_request_then_is_restarted(service, colocated_reference):
    ps, ref = colocated_reference
    pool = service.pool
    got: list[int] = []
    err: list[BaseException] = []

    def long_request() -> None:
        try:
            with GenerationClient(service.address, timeout_s=120) as c:
                for ch in c.generate(list(range(3, 80)), max_tokens=3000, method="dflash", ignore_eos=True):
                    got.extend(ch.token_ids)
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    wait_until(lambda: len(got) >= 10, "the long request to stream")
    pool.launcher.kill(pool.slots["decode"][0].launched)
    t.join(60)
    assert not t.is_alive()
    assert len(err) == 1 and isinstance(err[0], GenerationUnavailable), err
    assert err[0].code == grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: pool.restarts["decode"] == 1 and pool.healthy_count("decode") == 1,
               "the decode process to be restarted", timeout_s=120)
    with GenerationClient(service.address, timeout_s=60) as c:
        out = stream(c, ps[4], **request_kw(4))
    assert (out[0], out[1]["acceptance_lengths"]) == ref[4]


def test_a_dead_bridge_does_not_mark_the_prefill_worker_down(service, colocated_reference):
    """The bridge SIGKILLed: a prefill whose publish fails falls back to a decode-side prefill (exact, counted as
    failed_precondition), and the prefill worker, which is healthy, is neither marked down nor restarted (its
    publish failure used to come back as UNAVAILABLE, the code of a worker gone)."""
    ps, ref = colocated_reference
    router, pool = service.backend, service.pool
    pre = pool.slots["prefill"][0]
    restarts, before = pool.restarts["prefill"], router.fallbacks["failed_precondition"]
    pool.launcher.kill(pool.slots["bridge"][0].launched)
    with GenerationClient(service.address, timeout_s=60) as c:
        got = stream(c, ps[3], **request_kw(3))
    assert (got[0], got[1]["acceptance_lengths"]) == ref[3]
    assert router.fallbacks["failed_precondition"] == before + 1, dict(router.fallbacks)
    assert pre.healthy and pool.restarts["prefill"] == restarts
    wait_until(lambda: pool.restarts["bridge"] >= 1 and pool.healthy_count("bridge") == 1,
               "the bridge to be restarted", timeout_s=120)


def test_flashpd_serve_yaml_config_local_mode(dflash_pair, colocated_reference, tmp_path):  # noqa: F811
    ps, ref = colocated_reference
    # warm-up on (a GPU's default): each worker process runs its throwaway requests before it serves, and
    # the service's outputs stay those of the colocated reference
    cfg = serve_cfg(dflash_pair, "local", metrics_port=0, warmup=True).to_dict()
    text = "\n".join(f"{k}: {json.dumps(v)}" for k, v in cfg.items() if v is not None)  # JSON values are YAML
    (tmp_path / "serve.yaml").write_text(text + "\n")
    with serve_process(["--config", str(tmp_path / "serve.yaml")], start_timeout_s=120) as (address, metrics):
        assert metrics, "no metrics endpoint printed"
        with GenerationClient(address, timeout_s=60) as c:
            out = stream(c, ps[5], **request_kw(5))
            assert (out[0], out[1]["acceptance_lengths"]) == ref[5]
            assert c.health()["serving"]

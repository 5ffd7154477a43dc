"""The service disaggregated on a real local Ray cluster (CPU, the trained tiny pair, real gRPC on
127.0.0.1): (b) equals (a) colocated token for token and step for step under 32 concurrent
streams, the router's status codes, cancellation frees the decode worker's KV, metrics, and the
faults: a prefill actor killed mid-request (decode recomputes, exact), a decode actor killed mid-stream (its
requests resume on the other one after the tokens already streamed, a greedy one exactly, others keep going),
and the router restarting the dead actors."""
from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest

from flashpd.cluster.generation_client import (GenerationClient, GenerationInvalidArgument,
                                               GenerationResourceExhausted)
from flashpd.cluster.service import start_service
from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator

from tests._cluster_helpers import (N_PROMPTS, Streamer, busy_decode_slot, colocated_reference,  # noqa: F401
                                    dflash_pair, ray_cluster, request_kw, run_concurrently, serve_cfg, stream,
                                    wait_until)

ray = pytest.importorskip("ray")
from flashpd.cluster.ray_launcher import RayLauncher  # noqa: E402  (needs ray)
from flashpd.engine.scheduler import generate


@pytest.fixture(scope="module")
def service(ray_cluster, dflash_pair):  # noqa: F811
    svc = start_service(serve_cfg(dflash_pair, "ray", prefill_workers=1, decode_workers=2, metrics_port=0),
                        RayLauncher())
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def fault_service(ray_cluster, dflash_pair):  # noqa: F811
    """Each prefill sleeps 2 s first: a window to kill the prefill actor mid-request. KV for 2,048 positions."""
    svc = start_service(serve_cfg(dflash_pair, "ray", prefill_workers=1, decode_workers=2, kv_cache_tokens=2048,
                                  fault_prefill_delay_s=2.0), RayLauncher())
    yield svc
    svc.stop()


def _scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for ln in text.splitlines():
        if ln and not ln.startswith("#"):
            name, value = ln.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _sum(metrics: dict[str, float], prefix: str, *needles: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix) and all(n in k for n in needles))


def test_ray_disaggregated_equals_colocated_under_32_concurrent_streams(service, colocated_reference):
    ps, ref = colocated_reference
    got = run_concurrently(service.address, list(range(N_PROMPTS)), ps)
    for i in range(N_PROMPTS):
        assert got[i][0] == ref[i][0], f"tokens of request {i}"
        assert got[i][1] == ref[i][1], f"acceptance lengths of request {i}"
    router = service.backend
    assert sum(router.fallbacks.values()) == 0 and router.retries == 0
    # the prompts came through the bridge: every full 32-token chunk but the last position's
    hits = sum(((len(p) - 1) // 32) * 32 for p in ps)
    dec = [_scrape(s.launched.metrics_address) for s in service.pool.slots["decode"]]
    assert sum(_sum(m, "flashpd_cache_tokens_total", 'result="hit"') for m in dec) == hits
    assert sum(_sum(m, "flashpd_bridge_bytes_total", 'direction="import"') for m in dec) > 0
    assert all(_sum(m, "flashpd_bridge_gbps", "import") > 0 for m in dec)
    assert all("flashpd_queue_depth{role=\"decode\"}" in m for m in dec)
    pre = _scrape(service.pool.slots["prefill"][0].launched.metrics_address)
    assert _sum(pre, "flashpd_bridge_bytes_total", 'direction="export"') > 0
    assert _sum(pre, "flashpd_ttft_seconds_count", 'role="prefill"') == N_PROMPTS
    br = _scrape(service.pool.slots["bridge"][0].launched.metrics_address)
    assert _sum(br, "flashpd_bridge_store_lookups_total", 'tier="memory"', 'result="hit"') > 0
    rt = _scrape(service.metrics_address)
    assert _sum(rt, "flashpd_ttft_seconds_count", 'role="router"') >= N_PROMPTS
    assert _sum(rt, "flashpd_latency_seconds_count", 'role="router"') >= N_PROMPTS
    assert _sum(rt, "flashpd_tau_count") > 0 and _sum(rt, "flashpd_accepted_tokens_total", 'position="1"') > 0
    assert _sum(rt, "flashpd_workers_healthy", 'worker="decode"') == 2


@pytest.mark.parametrize("kw, field", [
    (dict(prompt=[]), "prompt_ids"),
    (dict(prompt=[1, 2], max_tokens=0), "max_tokens"),
    (dict(prompt=[1, 2], method="beam"), "method"),
    (dict(prompt=[1, 2], method="dflash", block_size=17), "block_size"),
    (dict(prompt=[1, 2], temperature=-1.0), "temperature"),
])
def test_router_refuses_bad_input_with_invalid_argument(service, kw, field):
    kw.setdefault("max_tokens", 4)
    with GenerationClient(service.address, timeout_s=30) as c:
        with pytest.raises(GenerationInvalidArgument) as ei:
            list(c.generate(**kw))
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in str(ei.value)


def test_router_resource_exhausted_when_the_prompt_cannot_fit(fault_service):
    with GenerationClient(fault_service.address, timeout_s=30) as c:
        with pytest.raises(GenerationResourceExhausted) as ei:  # within the model's 4,096 positions, beyond the KV
            c.generate_once([1] * 1500, max_tokens=1000)
        assert "KV blocks" in str(ei.value)
        with pytest.raises(GenerationResourceExhausted) as ei:  # beyond the model's positions
            c.generate_once([1] * 100, max_tokens=5000)
        assert "max_tokens" in str(ei.value)


def test_client_cancel_frees_the_decode_workers_kv(service):
    slots = service.pool.slots["decode"]
    with GenerationClient(service.address, timeout_s=60) as c:
        it = c.generate(list(range(3, 90)), max_tokens=3000, method="dflash", ignore_eos=True)
        got = 0
        for ch in it:
            got += len(ch.token_ids)
            if got >= 8:
                break
        busy = [s for s in slots if s.client.health(5)["running"] > 0]
        assert len(busy) == 1 and busy[0].client.health(5)["kv_blocks_free"] < busy[0].info["kv_blocks_total"]
        it.close()  # cancels the RPC: router -> decode worker -> scheduler frees the blocks
    for s in slots:
        wait_until(lambda s=s: (lambda h: h["running"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"])(
            s.client.health(5)), f"decode worker {s.index} to free its KV")


def test_prefill_killed_mid_request_decode_recomputes_and_router_restarts_it(fault_service, colocated_reference):
    svc, (ps, ref) = fault_service, colocated_reference
    router, pool = svc.backend, svc.pool
    i = next(k for k in range(N_PROMPTS) if request_kw(k)["method"] == "dflash" and len(ps[k]) > 64)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=_stream_at(svc.address, ps[i], request_kw(i))), daemon=True)
    t.start()
    prefill = pool.slots["prefill"][0]
    wait_until(lambda: prefill.client.health(5)["running"] == 1, "the prefill to start")
    pool.launcher.kill(prefill.launched)  # ray.kill, mid-prefill
    t.join(60)
    assert not t.is_alive()
    toks, stats = result["out"]
    assert toks == ref[i][0] and stats["acceptance_lengths"] == ref[i][1]
    assert sum(router.fallbacks.values()) >= 1
    wait_until(lambda: pool.restarts["prefill"] >= 1 and pool.healthy_count("prefill") == 1,
               "the router to restart the prefill actor", timeout_s=120)
    before = sum(router.fallbacks.values())
    j = next(k for k in range(N_PROMPTS) if k != i and request_kw(k)["method"] == "dflash")
    toks, stats = _stream_at(svc.address, ps[j], request_kw(j))
    assert toks == ref[j][0] and stats["acceptance_lengths"] == ref[j][1]
    assert sum(router.fallbacks.values()) == before  # the restarted prefill actor served it


def _stream_at(address: str, prompt: list[int], kw: dict):
    with GenerationClient(address, timeout_s=120) as c:
        return stream(c, prompt, **kw)


def test_decode_actor_killed_mid_stream_its_requests_resume_and_the_service_keeps_serving(fault_service, dflash_pair):  # noqa: F811
    svc = fault_service
    router, pool = svc.backend, svc.pool
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    solo = DFlashGenerator(ModelRunner(target, 256, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter, ())
    pa, pc = list(range(5, 70)), list(range(40, 100))
    ref = {id(p): generate(solo, [p], [SamplingParams(max_tokens=400, ignore_eos=True)])[0] for p in (pa, pc)}

    a = Streamer(svc.address, pa, max_tokens=400, method="dflash", ignore_eos=True)
    wait_until(lambda: len(a.tokens) >= 5, "request A to stream")
    slot_a = busy_decode_slot(pool)
    # B: sampled without a seed: another worker cannot replay it, it resumes after the tokens B already has
    b = Streamer(svc.address, list(range(7, 60)), max_tokens=400, method="dflash", temperature=1.0, ignore_eos=True)
    wait_until(lambda: len(b.tokens) >= 5, "request B to stream")
    slot_b = busy_decode_slot(pool, exclude=(slot_a,))
    pool.launcher.kill(slot_b.launched)
    b.join()
    assert b.error is None and len(b.tokens) == 400 and b.stats["acceptance_lengths"], b.error
    a.join()  # A, on the other worker (B's resumed rest beside it), was not disturbed
    assert a.error is None and a.tokens == ref[id(pa)].output
    assert a.stats["acceptance_lengths"] == ref[id(pa)].stats.acceptance_lengths

    wait_until(lambda: pool.restarts["decode"] >= 1 and pool.healthy_count("decode") == 2,
               "the router to restart the decode actor", timeout_s=120)
    c = Streamer(svc.address, pc, max_tokens=400, method="dflash", ignore_eos=True)
    wait_until(lambda: len(c.tokens) >= 20, "request C to stream")
    pool.launcher.kill(busy_decode_slot(pool).launched)
    c.join()  # greedy: resumed on the other decode worker after what was already streamed
    assert c.error is None, c.error
    assert c.tokens == ref[id(pc)].output
    # the stats are the resumed worker's: the uninterrupted run's steps after the cut, and only those
    acc, tail = ref[id(pc)].stats.acceptance_lengths, c.stats["acceptance_lengths"]
    assert 0 < len(tail) < len(acc) and tail == acc[len(acc) - len(tail):]
    assert router.retries == 2


def test_a_ray_prefill_actors_shared_caches_leave_dev_shm_when_it_dies_and_when_it_stops(ray_cluster, dflash_pair):  # noqa: F811
    """kv_transport "device" on a CPU: the prefill actor's caches are torch shared memory (torch_<pid>_*). A killed
    actor's torch_shm_manager dies with it before unlinking them, so each crash, stop and job stop left a whole KV
    cache in /dev/shm. The launcher removes them once the actor's process is gone; the restart asks for the options
    the first start was placed with. A request after the restart is served by the same decode actor: it used to
    abort as it dropped the dead exporter's tensors, mapped through that exporter's torch_shm_manager, which Ray
    killed with the actor (kv_bridge/host_share.py)."""
    from pathlib import Path  # noqa: PLC0415

    svc = start_service(serve_cfg(dflash_pair, "ray", prefill_workers=1, decode_workers=1, kv_transport="device"),
                        RayLauncher())
    pool = svc.pool
    stopped = False
    try:
        def one(seed: int) -> None:
            with GenerationClient(svc.address, timeout_s=60) as c:
                c.generate_once([(seed * 7 + j) % 120 + 1 for j in range(50)], max_tokens=4, method="native",
                                ignore_eos=True)

        def pid() -> int:
            return pool.launcher._actors[pool.slots["prefill"][0].launched.handle].where[0]

        one(1)
        first = pid()
        assert list(Path("/dev/shm").glob(f"torch_{first}_*"))  # its caches, shared by file name
        placed = dict(pool.launcher._placed)
        pool.launcher.kill(pool.slots["prefill"][0].launched)
        wait_until(lambda: pool.restarts["prefill"] >= 1 and pool.healthy_count("prefill") == 1,
                   "the prefill actor to restart", timeout_s=120)
        second = pid()
        assert second != first and not list(Path("/dev/shm").glob(f"torch_{first}_*"))
        assert pool.launcher._placed == placed
        one(2)  # imported from the new exporter, the dead one's mapping dropped
        one(3)
        assert pool.restarts["decode"] == 0 and pool.healthy_count("decode") == 1
        svc.stop()
        stopped = True
        assert not list(Path("/dev/shm").glob(f"torch_{second}_*"))
    finally:
        if not stopped:
            svc.stop()

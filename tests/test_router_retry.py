"""The router retries a request whose decode worker is gone on another one. While the client has seen none of that
decode's tokens it starts over from the prefill's first token, as if the dead worker had never run; after, it
resumes: the next worker rebuilds the caches of the prompt and the tokens streamed and continues from there (a
sampled request too; a greedy one gives the uninterrupted tokens: tests/test_cluster_ray.py kills a decode actor
mid-stream). Local processes on 127.0.0.1."""
from __future__ import annotations

import pytest

from flashpd.cluster.generation_client import GenerationClient
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.service import start_service
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate

from tests._cluster_helpers import dflash_pair, serve_cfg, wait_until  # noqa: F401


@pytest.fixture(scope="module")
def service(dflash_pair):  # noqa: F811
    # probes far apart: the router, not the pool's prober, finds the dead worker
    svc = start_service(serve_cfg(dflash_pair, "local", prefill_workers=1, decode_workers=2, health_interval_s=60.0,
                                  decode_retries=1))
    yield svc
    svc.stop()


def test_a_sampled_request_on_a_dead_decode_worker_is_retried_on_another(service):
    pool = service.pool
    dead = pool.slots["decode"][0]  # the idle pool picks the lowest index first
    pool.launcher.kill(dead.launched)  # SIGKILL, waited for
    with GenerationClient(service.address, timeout_s=60) as c:
        r = c.generate_once(list(range(3, 60)), max_tokens=12, method="native", ignore_eos=True, temperature=1.0)
    assert len(r.token_ids) == 12 and r.finish_reason == "length"
    assert service.backend.retries == 1 and not dead.healthy


def test_a_lease_release_that_fails_in_any_way_is_logged_not_raised(caplog):
    """The router's cleanup releases a cancelled request's prefill lease before it frees the request's decode slot
    and in-flight count: a release failing other than as an RPC (a channel a restart closed raises ValueError) must
    not skip the rest."""
    from types import SimpleNamespace

    from flashpd.cluster.router import Router

    def closed_channel(*_a, **_k):
        raise ValueError("Cannot invoke RPC on closed channel!")

    slot = SimpleNamespace(client=SimpleNamespace(release=closed_channel))
    reply = pb.PrefillReply(handoff=pb.Handoff(exporter_id="ex", lease_id=7))
    with caplog.at_level("WARNING", logger="flashpd.cluster.router"):
        Router._release_lease(None, slot, reply)  # the method reads nothing of the router
    assert "releasing lease 7" in caplog.text and "closed channel" in caplog.text


def test_a_call_on_a_channel_a_restart_closed_is_a_worker_gone_not_a_bad_request(service):
    """A request that picked a slot just before a restart swapped its client calls the old, closed channel: grpc
    raises ValueError, which the API answered as INVALID_ARGUMENT (the client's fault). It is the worker gone: the
    prefill falls back to the decode worker, the decode is retried on another; the tokens are those of a healthy
    service."""
    import time

    pool = service.pool
    deadline = time.monotonic() + 90
    while not all(s.healthy for s in pool.all()) and time.monotonic() < deadline:  # the first test's restart
        time.sleep(0.2)
    assert all(s.healthy for s in pool.all())
    prompt = list(range(5, 70))
    with GenerationClient(service.address, timeout_s=60) as c:
        ref = c.generate_once(prompt, max_tokens=10, method="native", ignore_eos=True).token_ids
        slots = (pool.slots["prefill"][0], pool.slots["decode"][0])
        saved = [s.client for s in slots]
        try:
            for s in slots:  # as restart() leaves the old client of a slot a request already holds
                s.client = pool._client(s.launched)
                s.client.close()
            r = c.generate_once(prompt, max_tokens=10, method="native", ignore_eos=True)
        finally:
            for s, old in zip(slots, saved):
                s.client = old
                s.healthy = True
    assert r.token_ids == ref
    assert service.backend.retries >= 1 and service.backend.fallbacks.get("unavailable", 0) >= 1


def test_the_decode_workers_resume_checks(service, dflash_pair):  # noqa: F811
    """Straight to a decode worker: a resumed output the request ends with (max_tokens reached) ends it at once with
    no tokens; a resumed greedy request streams the rest of the uninterrupted run; an id out of the vocabulary, or
    resumed output beside a first token, is refused by name."""
    import grpc

    from flashpd.cluster.generation_client import build_request
    from flashpd.cluster.generation_server import PROTOCOL_VERSION

    target = load_target(dflash_pair.target_dir)
    prompt = list(range(10, 50))
    ref = generate(NativeGenerator(ModelRunner(target, 256, 16)), [prompt],
                   [SamplingParams(max_tokens=30, ignore_eos=True)])[0].output
    pool = service.pool
    wait_until(lambda: any(s.healthy for s in pool.slots["decode"]), "a decode worker in rotation", timeout_s=90)
    dec = next(s for s in pool.slots["decode"] if s.healthy).client

    def call(resumed, max_tokens=30, **kw):
        req = build_request(prompt, max_tokens=max_tokens, method="native", ignore_eos=True)
        return list(dec.decode(pb.DecodeRequest(version=PROTOCOL_VERSION, request=req, resumed_output=resumed,
                                                **kw), 60))

    ended = call(ref[:3], max_tokens=3)
    assert [(list(c.token_ids), c.finished, c.finish_reason) for c in ended] == [([], True, "length")]
    chunks = call(ref[:12])
    assert [t for c in chunks for t in c.token_ids] == ref[12:] and chunks[-1].finish_reason == "length"
    for resumed, kw, what in (([1, target.cfg.vocab_size], {}, "resumed_output[1]"),
                              ([1, 2], {"first_token": 1}, "resumed_output: not with first_token")):
        with pytest.raises(grpc.RpcError) as ei:
            call(resumed, **kw)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in ei.value.details()


def test_a_worker_that_does_not_say_it_resumes_gets_a_replay(service, dflash_pair):  # noqa: F811
    """A decode worker of an older build drops DecodeRequest.resumed_output and would stream from the prompt, which
    the router would append after what the client has. Its Health does not say `resumes`: the router replays the
    request there from the prefill's first token (checked against what was streamed) instead. Here the worker is a
    current one with `resumes` taken out of its slot's Health: its final stats are the whole run's, a replay's."""
    from flashpd.engine.drafter import load_drafter
    from flashpd.engine.spec_decode import DFlashGenerator

    from tests._cluster_helpers import Streamer, busy_decode_slot

    pool = service.pool
    wait_until(lambda: all(s.healthy for s in pool.all()), "every worker in rotation", timeout_s=90)
    assert all(s.info["resumes"] for s in pool.slots["decode"])  # a current worker says so
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    prompt = list(range(40, 100))
    ref = generate(DFlashGenerator(ModelRunner(target, 256, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter,
                                   ()), [prompt], [SamplingParams(max_tokens=400, ignore_eos=True)])[0]
    retries = service.backend.retries
    c = Streamer(service.address, prompt, max_tokens=400, method="dflash", ignore_eos=True)
    wait_until(lambda: len(c.tokens) >= 20, "the request to stream")
    busy = busy_decode_slot(pool)
    other = next(s for s in pool.slots["decode"] if s is not busy)
    other.info = {**other.info, "resumes": False}  # as an older build's Health reads (the probes are 60 s apart)
    pool.launcher.kill(busy.launched)
    c.join()
    assert c.error is None, c.error
    assert c.tokens == ref.output
    assert c.stats["acceptance_lengths"] == ref.stats.acceptance_lengths  # the whole run: replayed, not resumed
    assert service.backend.retries == retries + 1

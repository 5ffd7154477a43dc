"""Prefill on one worker, decode on another, KV + drafter state through a real gRPC bridge:
tokens and per-step acceptance lengths equal a colocated run."""
from __future__ import annotations

import torch

from flashpd.engine.scheduler import generate, Scheduler
from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.client import BridgeClient, RemoteStore
from flashpd.kv_bridge.keys import MethodFingerprint
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.server import serve
from flashpd.kv_bridge.store import MemoryStore
from flashpd.prefill_node.worker import PrefillWorker

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)


def test_disaggregated_prefill_and_decode_equal_colocated(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    taps = tuple(drafter.cfg.target_layer_ids)
    fp = MethodFingerprint("fixture-target", "fixture-drafter", taps, "float32").digest()
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 126, (int(n),), generator=g).tolist() for n in torch.randint(130, 400, (10,), generator=g)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    colocated = generate(DFlashGenerator(ModelRunner(target, 1024, 16, taps=taps), drafter, ()), prompts, [params] * 10)

    server, port = serve(MemoryStore(1 << 30))
    try:
        with BridgeClient(f"127.0.0.1:{port}") as pc, BridgeClient(f"127.0.0.1:{port}") as dc:
            prefill = PrefillWorker(ModelRunner(target, 256, 16, taps=taps), drafter, PrefixCache(RemoteStore(pc), fp, 64))
            firsts = [prefill.prefill(p, params) for p in prompts]
            assert all(r.published_chunks == len(p) // 64 for r, p in zip(firsts, prompts))
            decode_cache = PrefixCache(RemoteStore(dc, transport="shm"), fp, 64)
            sched = Scheduler(ModelRunner(target, 1024, 16, taps=taps), drafter, prefix_cache=decode_cache)
            reqs = [sched.add(p, params, "dflash", first_token=f.first_token) for p, f in zip(prompts, firsts)]
            sched.run_until_idle()
    finally:
        server.stop(grace=None).wait(10)
    # fetches run concurrently off the engine loop, so requests are admitted (and counted) in the order their
    # data arrived: every prompt's whole prefix hits, in some order
    assert sorted(decode_cache.stats.per_request_hits) == sorted(((len(p) - 1) // 64) * 64 for p in prompts)
    for c, r, f in zip(colocated, reqs, firsts):
        assert r.seq.output[0] == f.first_token == c.output[0]
        assert r.seq.output == c.output
        assert r.seq.stats.acceptance_lengths == c.stats.acceptance_lengths


def test_forced_first_token_is_committed_and_decoding_continues_from_it(dflash_pair):  # noqa: F811
    """What the client already saw wins: decoding continues from the streamed first token."""
    from flashpd.engine.generate import NativeGenerator
    target = load_target(dflash_pair.target_dir)
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    own = generate(NativeGenerator(ModelRunner(target, 64, 16)), [prompt], [params])[0].output
    forced = (own[0] + 1) % 120
    sched = Scheduler(ModelRunner(target, 64, 16))
    r = sched.add(prompt, params, "native", first_token=forced)
    sched.run_until_idle()
    cont = generate(NativeGenerator(ModelRunner(target, 64, 16)), [prompt + [forced]], [SamplingParams(
        max_tokens=11, ignore_eos=True)])[0].output
    assert r.seq.output == [forced] + cont


def test_per_request_hits_stay_bounded_however_many_prompts_a_cache_restores(dflash_pair, monkeypatch):  # noqa: F811
    """`per_request_hits` took one entry per restore for as long as a worker served (every prefill of a prefill
    worker, every admission of a decode worker with a bridge): it keeps the latest ones only, while the counters
    count every restore."""
    import flashpd.kv_bridge.prefix_cache as prefix_cache

    monkeypatch.setattr(prefix_cache, "PER_REQUEST_HITS_KEPT", 4)
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    taps = tuple(drafter.cfg.target_layer_ids)
    fp = MethodFingerprint("fixture-target", "fixture-drafter", taps, "float32").digest()
    cache = PrefixCache(MemoryStore(1 << 26), fp, 64)
    prefill = PrefillWorker(ModelRunner(target, 64, 16, taps=taps), drafter, cache)
    prompt = torch.randint(0, 126, (140,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(13):
        res = prefill.prefill(prompt, params)
        assert res.cached_tokens == (0 if i == 0 else 128)
    assert cache.stats.requests == 13 and cache.stats.hit_tokens == 12 * 128
    assert 4 <= len(cache.stats.per_request_hits) <= 8 and set(cache.stats.per_request_hits) == {128}


class GatedStore:
    """A store in front of a bridge whose puts wait for `go` (a bridge slower than the prefill), or fail."""

    def __init__(self, inner, fail: bool = False) -> None:
        import threading
        self.inner, self.fail, self.go = inner, fail, threading.Event()

    def put_many(self, chunks):
        self.go.wait(30)
        if self.fail:
            raise ConnectionError("the bridge went away")
        return self.inner.put_many(chunks)

    def put(self, c):
        return self.put_many([c]) == 1

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_prefill_answers_before_its_publish_and_the_decode_worker_finds_the_whole_prefix(dflash_pair):  # noqa: F811
    """publish_after_answer: the first token comes back while the bridge has none of the prompt's chunks yet (its
    puts are held), from device copies, with the prefill's blocks already free; await_publish returns once they
    are there (once a ticket), and a decode worker then restores the whole prefix: tokens and acceptance equal
    colocated. A prefill whose prompt begins with a queued publish's first chunk waits for it and restores the
    shared prefix. A failed publish is await_publish's PublishFailed; an unknown ticket is UnknownTicket."""
    import threading
    import pytest
    from flashpd.prefill_node.worker import PublishFailed, PublishPending, UnknownTicket
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    taps = tuple(drafter.cfg.target_layer_ids)
    fp = MethodFingerprint("fixture-target", "fixture-drafter", taps, "float32").digest()
    g = torch.Generator().manual_seed(22)
    prompts = [torch.randint(0, 126, (int(n),), generator=g).tolist() for n in (300, 200)]
    shared = prompts[0][:150] + torch.randint(0, 126, (60,), generator=g).tolist()  # prompt 0's first two chunks
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    colocated = generate(DFlashGenerator(ModelRunner(target, 1024, 16, taps=taps), drafter, ()), prompts, [params] * 2)
    server, port = serve(MemoryStore(1 << 30))
    try:
        with BridgeClient(f"127.0.0.1:{port}") as pc, BridgeClient(f"127.0.0.1:{port}") as dc:
            gated = GatedStore(RemoteStore(pc))
            runner = ModelRunner(target, 256, 16, taps=taps)
            prefill = PrefillWorker(runner, drafter, PrefixCache(gated, fp, 64), publish_after_answer=True)
            free = runner.allocator.num_free
            firsts = [prefill.prefill(p, params) for p in prompts]
            assert runner.allocator.num_free == free  # every block back: the publishes read copies
            assert [f.published_chunks for f in firsts] == [len(p) // 64 for p in prompts]
            assert all(f.publish_ticket for f in firsts) and firsts[0].publish_ticket != firsts[1].publish_ticket
            remote = RemoteStore(dc)
            assert remote.stats()["store.entries"] == 0  # answered, nothing in the bridge yet
            with pytest.raises(PublishPending):
                prefill.await_publish(firsts[0].publish_ticket, 0.05)
            later = []
            t = threading.Thread(target=lambda: later.append(prefill.prefill(shared, params)))
            t.start()
            t.join(0.5)
            assert t.is_alive()  # waits for prompt 0's publish: its first chunk is this prompt's
            gated.go.set()
            t.join(30)
            assert later and later[0].cached_tokens == 128  # restored what prompt 0 published, not recomputed
            assert [prefill.await_publish(f.publish_ticket, 30) for f in firsts] == [len(p) // 64 for p in prompts]
            with pytest.raises(UnknownTicket):  # once a ticket
                prefill.await_publish(firsts[0].publish_ticket, 1)
            with pytest.raises(UnknownTicket):
                prefill.await_publish(10_000, 1)
            assert prefill.await_publish(later[0].publish_ticket, 30) == 1  # its third chunk: the rest were there
            assert remote.stats()["store.entries"] == sum(len(p) // 64 for p in prompts) + 1
            decode_cache = PrefixCache(RemoteStore(dc, transport="shm"), fp, 64)
            sched = Scheduler(ModelRunner(target, 1024, 16, taps=taps), drafter, prefix_cache=decode_cache)
            reqs = [sched.add(p, params, "dflash", first_token=f.first_token) for p, f in zip(prompts, firsts)]
            sched.run_until_idle()
            assert sorted(decode_cache.stats.per_request_hits) == sorted(((len(p) - 1) // 64) * 64 for p in prompts)
            for c, r in zip(colocated, reqs):
                assert r.seq.output == c.output and r.seq.stats.acceptance_lengths == c.stats.acceptance_lengths
            failing = GatedStore(RemoteStore(pc), fail=True)
            failing.go.set()
            prefill = PrefillWorker(runner, drafter, PrefixCache(failing, fp, 64), publish_after_answer=True)
            res = prefill.prefill([3 + i % 100 for i in range(135)], params)
            with pytest.raises(PublishFailed, match="went away") as e:
                prefill.await_publish(res.publish_ticket, 30)
            assert e.value.__context__ is None and e.value.__cause__ is None  # no frame keeps the copies
            assert prefill.publisher.failures == 1 and runner.allocator.num_free == free
    finally:
        server.stop(grace=None).wait(10)


def test_a_prefill_past_the_publish_bound_publishes_before_it_answers(dflash_pair):  # noqa: F811
    """The copies queued already fill max_pending_bytes: the next prefill publishes its own chunks before it answers
    (no ticket), as prefill_publish before_answer does, rather than queue past the bound."""
    import threading
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    taps = tuple(drafter.cfg.target_layer_ids)
    fp = MethodFingerprint("fixture-target", "fixture-drafter", taps, "float32").digest()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a, b = [3 + i % 100 for i in range(140)], [7 + i % 90 for i in range(140)]
    server, port = serve(MemoryStore(1 << 30))
    try:
        with BridgeClient(f"127.0.0.1:{port}") as pc:
            gated = GatedStore(RemoteStore(pc))
            prefill = PrefillWorker(ModelRunner(target, 64, 16, taps=taps), drafter, PrefixCache(gated, fp, 64),
                                    publish_after_answer=True, max_pending_bytes=1)
            first = prefill.prefill(a, params)  # an empty queue takes any one publish
            assert first.publish_ticket
            second = []
            t = threading.Thread(target=lambda: second.append(prefill.prefill(b, params)))
            t.start()
            t.join(0.5)
            assert t.is_alive()  # publishing before it answers: the bridge holds its puts
            gated.go.set()
            t.join(30)
            assert second and second[0].publish_ticket == 0 and second[0].published_chunks == 2
            assert prefill.await_publish(first.publish_ticket, 30) == 2
    finally:
        server.stop(grace=None).wait(10)

"""Prefill leases (the same-host device path) and worker liveness under load, on real local services (CPU, the
fixture pair): clients that leave at their first token, and DecodeRequests the decode worker refuses, give the
prefill worker's blocks back at once, not at a 120 s lease deadline; a decode worker whose server holds every
request it may take still answers its Health probes, and is not restarted; an importer drops the old mapping of
an exporter that came back under a new id.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from flashpd.cluster.generation_client import build_request
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc
from flashpd.cluster.service import start_service
from tests._cluster_helpers import serve_cfg, wait_until
from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)

LEASE_S = 120.0  # far past every wait here: a lease freed in time was freed by a release, not its deadline


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 126, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def device_svc(dflash_pair):  # noqa: F811
    svc = start_service(serve_cfg(dflash_pair, "local", prefill_workers=1, decode_workers=1, kv_transport="device",
                                  handoff_lease_s=LEASE_S))
    yield svc
    svc.stop()


def _all_free(slot) -> bool:
    h = slot.client.health(5)
    return h["kv_blocks_free"] == h["kv_blocks_total"]


def test_clients_leaving_at_their_first_token_free_the_prefill_leases(device_svc):
    """24 concurrent DFlash requests, every other one cancelled by its client as its first token arrives (some
    before the decode worker saw the call): the prefill worker's blocks are all free within seconds."""
    pre = device_svc.pool.slots["prefill"][0]
    n = 24
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        with grpc.insecure_channel(device_svc.address) as ch:
            barrier.wait()
            call = pb_grpc.GenerationStub(ch).Generate(build_request(_prompt(i, 40 + 7 * i), max_tokens=30,
                                                                     method="dflash", ignore_eos=True), timeout=60)
            try:
                for c in call:
                    if i % 2 and c.token_ids:
                        call.cancel()
            except grpc.RpcError:
                pass

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    wait_until(lambda: _all_free(pre), "every prefill lease to be released", timeout_s=8)
    wait_until(lambda: _all_free(device_svc.pool.slots["decode"][0]), "the decode worker's blocks", timeout_s=8)


@pytest.mark.parametrize("flaw", ["draft-width", "no-first-token", "version"])
def test_a_decode_request_refused_by_the_decode_worker_frees_its_lease(device_svc, flaw):
    """A DecodeRequest carrying a live lease that the decode worker refuses (a draft width out of range, no
    first token, another protocol version) is released by the decode worker at once."""
    from flashpd.cluster.generation_server import PROTOCOL_VERSION

    pre, dec = device_svc.pool.slots["prefill"][0], device_svc.pool.slots["decode"][0]
    wait_until(lambda: _all_free(pre), "a quiet prefill worker", timeout_s=8)
    req = build_request(_prompt(1, 100), max_tokens=30, method="dflash")
    r = pre.client.prefill(req, 30)
    assert r.HasField("handoff") and not _all_free(pre)
    msg = pb.DecodeRequest(version=PROTOCOL_VERSION, request=req, first_token=r.first_token, handoff=r.handoff)
    if flaw == "draft-width":
        msg.request.CopyFrom(build_request(_prompt(1, 100), max_tokens=30, method="dflash", block_size=40))
    elif flaw == "no-first-token":
        msg.ClearField("first_token")
    else:
        msg.version = PROTOCOL_VERSION + 1
    with pytest.raises(grpc.RpcError) as e:
        list(dec.client.decode(msg, 10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_until(lambda: _all_free(pre), "the refused request's lease to be released", timeout_s=3)


def test_a_fully_loaded_decode_worker_answers_health_and_is_not_restarted(dflash_pair):  # noqa: F811
    """max_concurrent 4 and 4 long requests on the only decode worker: its server used to have exactly 4 calls, so
    its Health probes got RESOURCE_EXHAUSTED and the pool restarted it, failing all 4."""
    svc = start_service(serve_cfg(dflash_pair, "local", prefill_workers=1, decode_workers=1, max_concurrent=4,
                                  health_interval_s=0.2, health_failures=2))
    try:
        dec = svc.pool.slots["decode"][0]
        done, errors = [], []

        def one(i: int) -> None:
            with grpc.insecure_channel(svc.address) as ch:
                try:
                    n = sum(len(c.token_ids) for c in pb_grpc.GenerationStub(ch).Generate(
                        build_request(_prompt(50 + i, 40), max_tokens=1500, method="native", ignore_eos=True),
                        timeout=120))
                    done.append(n)
                except grpc.RpcError as e:
                    errors.append(e.code().name)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        wait_until(lambda: dec.client.health(3)["running"] == 4, "4 requests running at the decode worker",
                   timeout_s=30)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0 and any(t.is_alive() for t in ts):
            assert dec.client.health(3)["serving"]  # answered while every request's call is in flight
            time.sleep(0.2)
        for t in ts:
            t.join(150)
        assert (errors, done) == ([], [1500] * 4)
        assert sum(svc.pool.restarts.values()) == 0
    finally:
        svc.stop()


def test_an_importer_drops_an_exporter_that_came_back_under_a_new_id(dflash_pair):  # noqa: F811
    """Exporters in turn at one address (a prefill worker and its restarts): each import maps the new one's caches
    and drops the old one's, and the output stays exact; a second address keeps its own mapping."""
    from flashpd.engine.drafter import load_drafter
    from flashpd.engine.loader import load_target
    from flashpd.engine.sampling import SamplingParams
    from tests.test_handoff import _cold, _decode_side, _drain, _prefill_side, _release

    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    sched, released = _decode_side(target, drafter)
    importer = sched.handoff.importer
    p, sp = _prompt(3, 60), SamplingParams(max_tokens=12, ignore_eos=True)
    want = _cold(target, drafter, p, sp, "dflash")
    for i, address in enumerate(["127.0.0.1:5555"] * 3 + ["127.0.0.1:6666"]):
        pw = _prefill_side(target, drafter)
        pw.exporter.address = address
        res = pw.prefill(p, sp)
        assert res.handoff.exporter_address == address
        r = sched.add(p, sp, "dflash", first_token=res.first_token, handoff=res.handoff)
        _drain(sched)
        assert (r.seq.output, r.seq.stats.acceptance_lengths) == want
        assert sched.stats.handoff_imports == i + 1 and not sched.handoff.fallbacks
        assert importer.stats["mapped_exporters"] == (1 if i < 3 else 2), "an old exporter's caches stay mapped"
        assert released[-1] == res.handoff.lease_id and _release(pw, res.handoff)


def test_the_engine_loop_frees_the_lease_of_a_request_it_never_schedules(dflash_pair):  # noqa: F811
    """A request cancelled before the loop takes it, one whose submit future was cancelled, and one still queued
    when the loop stops: each lease goes back to its exporter (a decode worker's scheduler releases through it)."""
    from concurrent.futures import Future

    from flashpd.decode_node.engine_loop import EngineLoop, Handle
    from flashpd.engine.drafter import load_drafter
    from flashpd.engine.loader import load_target
    from flashpd.engine.sampling import SamplingParams
    from tests.test_handoff import _decode_side

    target = load_target(dflash_pair.target_dir)
    sched, released = _decode_side(target, load_drafter(dflash_pair.draft_dir, target))
    loop = EngineLoop(sched)
    try:
        sp = SamplingParams(max_tokens=4)
        lease = lambda i: type("Lease", (), {"lease_id": i})()  # noqa: E731  what the release reads
        cancelled = Handle([1, 2], sp, "dflash", None, 7, lease(1))
        cancelled.cancel_requested = True
        dropped_future = Future()
        dropped_future.cancel()
        loop._take([(cancelled, Future()), (Handle([1, 2], sp, "dflash", None, 7, lease(2)), dropped_future)])
        assert released == [1, 2] and cancelled.events.get(timeout=1).kind == "cancelled"
    finally:
        loop.stop()
    loop._inbox.append((Handle([1, 2], sp, "dflash", None, 7, lease(3)), Future()))
    loop._shutdown()
    assert released == [1, 2, 3]


def test_a_prefill_needs_room_for_its_prompt_not_its_output(dflash_pair):  # noqa: F811
    """A prefill worker computes the prompt and leases its blocks; nothing past it. A 100-token prompt asking for
    3,000 tokens fits a 64-block cache there (it was refused for the whole request's worst case, so with leases
    held, long-output requests fell back to a decode-side prefill); a prompt larger than the free blocks is still
    refused, with nothing held."""
    from flashpd.engine.drafter import load_drafter
    from flashpd.engine.kv_cache import OutOfBlocks
    from flashpd.engine.loader import load_target
    from flashpd.engine.sampling import SamplingParams
    from tests.test_handoff import _prefill_side

    target = load_target(dflash_pair.target_dir)
    pw = _prefill_side(target, load_drafter(dflash_pair.draft_dir, target), blocks=64)
    alloc = pw.gen.runner.allocator
    free0 = alloc.num_free
    res = pw.prefill(_prompt(5, 100), SamplingParams(max_tokens=3000, ignore_eos=True))
    assert res.handoff is not None and alloc.num_free == free0 - 7  # ceil(100 / 16) blocks under the lease
    with pytest.raises(OutOfBlocks):
        pw.prefill(_prompt(6, 16 * (free0 - 7) + 1), SamplingParams(max_tokens=1))
    assert alloc.num_free == free0 - 7
    assert pw.release(res.handoff.lease_id, res.handoff.blocks, res.handoff.epochs) and alloc.num_free == free0


def test_prefill_stubs_keep_a_bounded_number_of_channels():
    """One channel per prefill worker address, and a restarted worker comes back at a new port: past
    MAX_CHANNELS addresses the least recently used channel is closed, the ones in use are kept."""
    from flashpd.cluster.worker_client import PrefillStubs

    stubs = PrefillStubs()
    try:
        first = stubs.get("127.0.0.1:1")
        for port in range(2, PrefillStubs.MAX_CHANNELS + 10):
            stubs.get("127.0.0.1:1")  # in use all along: never the least recently used
            stubs.get(f"127.0.0.1:{port}")
        assert len(stubs._stubs) == PrefillStubs.MAX_CHANNELS
        assert stubs.get("127.0.0.1:1") is first and "127.0.0.1:2" not in stubs._stubs
    finally:
        stubs.close()


def test_a_lease_whose_answer_was_lost_is_freed_by_its_claim(device_svc):
    """A Prefill that made a lease whose answer its router never read (a cancel or deadline while the answer was on
    the wire): a Release naming the call's claim frees it; a Release that comes first frees it as it is made."""
    pre = device_svc.pool.slots["prefill"][0]
    wait_until(lambda: _all_free(pre), "a quiet prefill worker", timeout_s=8)
    req = build_request(_prompt(5, 100), max_tokens=30, method="dflash")
    r = pre.client.prefill(req, 30, claim=2 ** 64 - 1)
    assert r.HasField("handoff") and not _all_free(pre)
    assert pre.client.release_claim(2 ** 64 - 1, 5)
    wait_until(lambda: _all_free(pre), "the claimed lease to be released", timeout_s=3)
    assert not pre.client.release(r.handoff, 5)  # the decode worker's release, after: unknown, no harm
    assert not pre.client.release_claim(77, 5)  # before its Prefill: nothing to free yet
    r = pre.client.prefill(req, 30, claim=77)
    assert not r.HasField("handoff") and _all_free(pre)
    with pytest.raises(grpc.RpcError) as e:  # only the router sends claims: a malformed one is its bug, said
        pre.client._stub.Prefill(req, timeout=10, metadata=(("x-flashpd-prefill-claim", "-3"),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "claim" in e.value.details()


class _LostAnswer(grpc.RpcError):
    """What the router's Prefill call raises when its deadline passes as the answer arrives."""

    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


class _CancelledAfterAnswer:
    """A Prefill future whose call completes at the worker (its lease made) while its client cancels: the router's
    cancel (through RouterHandle.cancel) reaches the call with its answer on the wire, and result() raises as gRPC's
    does for such a call."""

    def __init__(self, call, answered: threading.Event) -> None:
        self.call, self.answered, self.cancelled = call, answered, threading.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True

    def result(self, timeout=None):
        self.call()
        self.answered.set()  # the test's client cancels now
        assert self.cancelled.wait(10), "the client's cancel did not reach the prefill call"
        raise grpc.FutureCancelledError()


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_a_prefill_answer_lost_to_a_cancel_or_deadline_frees_its_lease(device_svc, monkeypatch, how):
    """The race a review's cancellation fuzzing found: a client cancels (or its deadline passes) while the
    prefill's answer is on the wire; the worker saw its call alive and handed the lease to nobody, and the router,
    without the answer, could not name it: the prompt's blocks stayed held until handoff_lease_s (here 120 s). The
    race is made certain here: the router's Prefill call runs to its end at the worker, then raises as the lost
    answer does (the blocking call a deadline, the future a cancel, with a second request on the worker so the
    router takes the future). The router releases the lease by the call's claim, within seconds."""
    from flashpd.cluster.generation_client import GenerationClient, GenerationError

    pre = device_svc.pool.slots["prefill"][0]
    wait_until(lambda: _all_free(pre), "a quiet prefill worker", timeout_s=8)
    real_prefill = pre.client.prefill
    answered = threading.Event()

    def blocking(req, timeout, claim=None):
        real_prefill(req, timeout, claim=claim)
        raise _LostAnswer()

    monkeypatch.setattr(pre.client, "prefill", blocking)
    monkeypatch.setattr(pre.client, "prefill_future", lambda req, timeout, claim=None: _CancelledAfterAnswer(
        lambda: real_prefill(req, timeout, claim=claim), answered))
    prompt = _prompt(6, 90)
    if how == "deadline":
        with GenerationClient(device_svc.address, timeout_s=30) as c:
            with pytest.raises(GenerationError):  # (the request's timeout, or a decode-side prefill's fallback)
                c.generate_once(prompt, max_tokens=8, method="dflash", ignore_eos=True)
    else:
        held = device_svc.pool.pick("prefill")  # a call in flight on the worker: the router takes the future
        try:
            with grpc.insecure_channel(device_svc.address) as ch:
                call = pb_grpc.GenerationStub(ch).Generate(build_request(prompt, max_tokens=8, method="dflash",
                                                                         ignore_eos=True), timeout=30)
                threading.Thread(target=lambda: answered.wait(20) and call.cancel(), daemon=True).start()
                with pytest.raises(grpc.RpcError) as e:
                    list(call)
                assert e.value.code() == grpc.StatusCode.CANCELLED
        finally:
            device_svc.pool.release(held)
    monkeypatch.undo()
    wait_until(lambda: _all_free(pre), "the lost answer's lease to be released", timeout_s=3)

"""The router's robustness: every internal call is bounded by the request's own deadline (the client's, when it is
shorter than request_timeout_s: the submit's deadline_s), and a request whose deadline passes ends DEADLINE_EXCEEDED having given back what
it held (prefill lease, decode slot, in-flight count); a decode worker that answers RESOURCE_EXHAUSTED because it is
overloaded is a busy worker, not a bad prompt (another one is tried, else the client is told it is overloaded),
while a prompt a worker can never fit stays a prompt error; the counters its request threads bump are locked; a
request whose thread cannot start leaks nothing.

Real pieces throughout: a real Router over a real WorkerPool and WorkerClients, gRPC servers on 127.0.0.1, and
decode workers that are real DecodeWorkers (the tiny float32 checkpoint) behind the real DecodeWorkerServicer. Only
the behaviour the router must survive is scripted: a prefill worker that never answers in time, or one that
answers with a leased handoff, and a decode worker that streams nothing before the deadline. A worker's overload is
grpcio's own: a server whose every RPC slot is taken answers RESOURCE_EXHAUSTED ("Concurrent RPC limit exceeded")."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import grpc
import pytest

from conftest import new_runner
from flashpd.cluster.config import ServeConfig
from flashpd.cluster.generation_client import GenerationClient, GenerationTimeout, GenerationError
from flashpd.cluster.generation_server import PROTOCOL_VERSION, new_server, serve_generation
from flashpd.cluster.launcher import Launched
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc
from flashpd.cluster.router import Router
from flashpd.cluster.worker_client import WorkerClient
from flashpd.cluster.worker_pool import Slot, WorkerPool
from flashpd.cluster.worker_services import DecodeWorkerServicer
from flashpd.decode_node.worker import DecodeWorker
from flashpd.decode_node.engine_loop import Overloaded
from flashpd.engine.scheduler import PromptTooLong
from flashpd.engine.sampling import SamplingParams
from tests._counters import SlowCounter

WAIT_S = 8.0  # bound on every wait for the router: the old behaviour waited out prefill_timeout_s (30 s here)
CLIENT_DEADLINE_S = 2.0  # long enough that the router's thread starts well within it on a loaded machine
SLACK_S = 0.5  # what a worker may see beyond the client's deadline (the call's set-up)
PROMPT = list(range(3, 40))


# ---- workers ------------------------------------------------------------------------------------
class ScriptedPrefill(pb_grpc.PrefillWorkerServicer):
    """A prefill worker the router must survive. "hang": the prefill never finishes on its own (a worker stuck or
    queued behind long prompts); it returns once its call ended (deadline or cancel), as a real one would stop
    waiting. "lease": answers at once with a first token and a device-path handoff whose lease the router must
    release if the request fails. Records each call's time left and each Release."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.time_left: list[float | None] = []
        self.released: list[tuple[str, int]] = []
        self.ended = threading.Event()

    def Prefill(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.PrefillReply:
        self.time_left.append(context.time_remaining())
        if self.mode == "hang":
            while context.is_active():
                time.sleep(0.02)
            self.ended.set()
            return pb.PrefillReply(version=PROTOCOL_VERSION)
        return pb.PrefillReply(version=PROTOCOL_VERSION, first_token=5, prefill_ms=1.0,
                               handoff=pb.Handoff(exporter_id="exporter-1", exporter_address="127.0.0.1:1",
                                                  lease_id=7, num_tokens=len(request.prompt_ids.ids)))

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        self.released.append((request.exporter_id, int(request.lease_id)))
        return pb.ReleaseReply(version=PROTOCOL_VERSION, released=True)


class SilentDecode(pb_grpc.DecodeWorkerServicer):
    """A decode worker that streams nothing until its call ends (a slow, long generation): only the call's
    deadline, the request's, can end it."""

    def __init__(self) -> None:
        self.time_left: list[float | None] = []

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateChunk]:
        self.time_left.append(context.time_remaining())
        while context.is_active():
            time.sleep(0.02)
        return
        yield  # a response stream


class Holder(pb_grpc.PrefillWorkerServicer):
    """Registered beside a real decode worker on its server: a call to it holds one of the server's RPC slots
    until `free` is set (so the test can make that server overloaded, as many long streams would)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.free = threading.Event()

    def Prefill(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.PrefillReply:
        self.entered.set()
        self.free.wait(30)
        return pb.PrefillReply(version=PROTOCOL_VERSION)


@pytest.fixture(scope="module")
def tiny_dir(make_checkpoint):
    _, d = make_checkpoint()
    return d


@contextmanager
def decode_worker(tiny_dir, num_blocks: int = 64, max_rpcs: int = 8) -> Iterator[tuple[str, Holder]]:
    """A real decode worker (tiny float32 checkpoint, CPU) behind DecodeWorkerServicer; its server takes at most
    max_rpcs calls at once (the Holder's included), as a worker's server is bounded by max_concurrent."""
    worker = DecodeWorker(new_runner(tiny_dir, num_blocks=num_blocks))
    holder = Holder()
    server, port = new_server("127.0.0.1", 0, False, max_rpcs,
                              {"DecodeWorker": DecodeWorkerServicer(worker.loop), "PrefillWorker": holder})
    try:
        yield f"127.0.0.1:{port}", holder
    finally:
        holder.free.set()
        server.stop(None).wait(5)
        worker.stop(10)


@contextmanager
def scripted(name: str, servicer) -> Iterator[str]:
    server, port = new_server("127.0.0.1", 0, False, 8, {name: servicer})
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait(5)


def _slot(role: str, index: int, address: str, info: dict | None = None) -> Slot:
    client = WorkerClient(role, address)
    return Slot(role, index, Launched(role, index, address, None, None), client,
                info=info if info is not None else client.health(5.0))


def make_router(prefill: list[str], decode: list[str], info: dict | None = None, **kw) -> Router:
    """A Router over a pool of these workers (no launcher, no supervisor: the router alone marks workers down)."""
    cfg = ServeConfig(**{"target": "unused", "mode": "local", "prefill_timeout_s": 30.0, "request_timeout_s": 60.0,
                         **kw})
    pool = WorkerPool(cfg, launcher=None)  # type: ignore[arg-type]  (nothing is started or restarted)
    pool.slots["prefill"] = [_slot("prefill", i, a, info={}) for i, a in enumerate(prefill)]
    pool.slots["decode"] = [_slot("decode", i, a, info) for i, a in enumerate(decode)]
    return Router(cfg, pool)


def fake_decode_info() -> dict:
    """Health of a scripted decode worker (it serves no Health): what the tiny checkpoint's would say."""
    return dict(serving=True, has_drafter=False, running=0, waiting=0, kv_blocks_free=64, kv_blocks_total=64,
                kv_block_size=16, vocab_size=256, max_positions=1024, default_block_size=None)


def events(h, timeout_s: float = WAIT_S) -> list:
    """The handle's events up to its final one ("done" or "error"); fails if none came within timeout_s."""
    out, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ev = h.get(0.05)
        if ev is None:
            continue
        out.append(ev)
        if ev.kind in ("done", "error"):
            return out
    raise AssertionError(f"no final event within {timeout_s:g} s (got {[e.kind for e in out]})")


def wait_until(cond, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.02)


def assert_nothing_held(router: Router) -> None:
    try:
        wait_until(lambda: router.inflight == 0, "the router's in-flight count to drop to 0")
    except AssertionError as e:
        raise AssertionError(f"{e} (it is {router.inflight})") from None
    held = {(s.role, s.index): s.inflight for s in router.pool.slots["prefill"] + router.pool.slots["decode"]}
    assert all(v == 0 for v in held.values()), held


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


# ---- 1. the request's deadline bounds every internal call ------------------------------------------
def test_a_blocking_prefill_is_bounded_by_the_requests_deadline_and_ends_deadline_exceeded(tiny_dir):
    """The idle prefill worker gets the router's blocking call, which a cancel cannot reach: it must carry the
    request's remaining time, not prefill_timeout_s (30 s). The request ends with TimeoutError (the servicer's
    DEADLINE_EXCEEDED), not a recompute fallback, and holds nothing afterwards."""
    prefill = ScriptedPrefill("hang")
    with scripted("PrefillWorker", prefill) as p, decode_worker(tiny_dir) as (d, _):
        router = make_router([p], [d])
        t0 = time.monotonic()
        h = router.submit(PROMPT, GREEDY, "native", None, deadline_s=CLIENT_DEADLINE_S)
        evs = events(h)
        took = time.monotonic() - t0
        assert evs[-1].kind == "error" and isinstance(evs[-1].error, TimeoutError), evs
        assert "deadline" in str(evs[-1].error)
        assert took < CLIENT_DEADLINE_S + 5.0, took
        assert prefill.time_left and prefill.time_left[0] <= CLIENT_DEADLINE_S + SLACK_S, prefill.time_left
        assert sum(router.fallbacks.values()) == 0, dict(router.fallbacks)  # not a prefill fault: time ran out
        assert_nothing_held(router)


def test_a_prefill_worker_whose_prefill_timed_out_gets_no_new_requests_for_a_while(tiny_dir):
    """A prefill worker that answers Health but is stuck: the first request waits out prefill_timeout_s and falls
    back to the decode worker computing its prompt. The requests after it must not each wait out the same timeout:
    they fall back at once while the worker is suspended (prefill_timeout_s), and the first request after that
    tries it again."""
    prefill = ScriptedPrefill("hang")
    with scripted("PrefillWorker", prefill) as p, decode_worker(tiny_dir) as (d, _):
        router = make_router([p], [d], prefill_timeout_s=1.0)
        slot = router.pool.slots["prefill"][0]
        first = events(router.submit(PROMPT, GREEDY, "native", None))
        assert first[-1].kind == "done" and len(prefill.time_left) == 1
        assert dict(router.fallbacks) == {"deadline_exceeded": 1}
        assert slot.healthy and slot.suspended_until > time.monotonic()
        t0 = time.monotonic()
        second = events(router.submit(PROMPT, GREEDY, "native", None))
        assert second[-1].kind == "done" and time.monotonic() - t0 < 0.9  # no wait on the stuck worker
        assert len(prefill.time_left) == 1 and router.fallbacks["prefill_suspended"] == 1
        assert [t for e in first if e.kind == "tokens" for t in e.tokens] == \
            [t for e in second if e.kind == "tokens" for t in e.tokens]
        wait_until(lambda: slot.suspended_until <= time.monotonic(), "the suspension's end")
        third = events(router.submit(PROMPT, GREEDY, "native", None))
        assert third[-1].kind == "done" and len(prefill.time_left) == 2  # tried again, timed out again
        assert router.fallbacks["deadline_exceeded"] == 2 and slot.suspended_until > time.monotonic()
        assert_nothing_held(router)


class PublishingPrefill(pb_grpc.PrefillWorkerServicer):
    """A prefill worker that answers before its publish (publish_ticket 9): AwaitPublish returns once `done` is
    set, with `published` as given."""

    def __init__(self, published: bool = True) -> None:
        self.published = published
        self.done = threading.Event()
        self.awaited = threading.Event()
        self.tickets: list[int] = []

    def Prefill(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.PrefillReply:
        return pb.PrefillReply(version=PROTOCOL_VERSION, first_token=5, prefill_ms=1.0, published_chunks=1,
                               publish_ticket=9)

    def AwaitPublish(self, request: pb.AwaitPublishRequest, context) -> pb.AwaitPublishReply:
        self.tickets.append(int(request.ticket))
        self.awaited.set()
        self.done.wait(WAIT_S)
        return pb.AwaitPublishReply(version=PROTOCOL_VERSION, published=self.published,
                                    published_chunks=1 if self.published else 0,
                                    error="" if self.published else "ConnectionError: the bridge went away")


@pytest.mark.parametrize("published", [True, False])
def test_the_first_token_leaves_before_the_publish_and_the_decode_call_after_it(tiny_dir, published):
    """A prefill that answers before its publish: the router streams the first token at once, waits for the
    publish (AwaitPublish with the reply's ticket), then sends the decode call. A failed publish is a counted
    partial fallback: the request still completes (its decode worker computes what the bridge lacks)."""
    prefill = PublishingPrefill(published)
    with scripted("PrefillWorker", prefill) as p, decode_worker(tiny_dir) as (d, _):
        router = make_router([p], [d])
        h = router.submit(PROMPT, GREEDY, "native", None)
        assert prefill.awaited.wait(WAIT_S)
        first = h.get(WAIT_S)
        assert first.kind == "tokens" and first.tokens == [5]  # out while the publish is still awaited
        time.sleep(0.2)
        assert h.get(0.05) is None  # no decode tokens before the publish is done
        prefill.done.set()
        evs = events(h)
        assert evs[-1].kind == "done" and prefill.tickets == [9]
        assert dict(router.fallbacks) == ({} if published else {"publish_failed": 1})
        assert_nothing_held(router)


def test_a_clients_deadline_frees_the_router_in_time_through_the_grpc_front(tiny_dir):
    """End to end: a client with a 2 s deadline. Its RPC ends DEADLINE_EXCEEDED (gRPC's doing), and the router's
    request thread, its prefill worker's slot and the in-flight count must be free within seconds of it, not when
    prefill_timeout_s runs out."""
    prefill = ScriptedPrefill("hang")
    with scripted("PrefillWorker", prefill) as p, decode_worker(tiny_dir) as (d, _):
        router = make_router([p], [d])
        server, port = serve_generation(router)
        try:
            with GenerationClient(f"127.0.0.1:{port}") as c, pytest.raises(GenerationTimeout):
                c.generate_once(PROMPT, timeout_s=CLIENT_DEADLINE_S, max_tokens=8, method="native", ignore_eos=True)
            assert prefill.ended.wait(WAIT_S), "the prefill call outlived the client's deadline"
            assert prefill.time_left[0] <= CLIENT_DEADLINE_S + SLACK_S, prefill.time_left
            assert_nothing_held(router)
        finally:
            server.stop(None).wait(5)


def test_a_deadline_passing_during_decode_ends_the_request_and_releases_its_prefill_lease():
    """The prefill answered with a leased handoff; the decode worker then streams nothing before the request's
    deadline. The decode call must carry that deadline, and the request ends DEADLINE_EXCEEDED having released
    the lease at its prefill worker (else its KV blocks stay held until the lease expires), its decode slot and
    its in-flight count."""
    prefill, decode = ScriptedPrefill("lease"), SilentDecode()
    with scripted("PrefillWorker", prefill) as p, scripted("DecodeWorker", decode) as d:
        router = make_router([p], [d], info=fake_decode_info())
        h = router.submit(PROMPT, GREEDY, "native", None, deadline_s=CLIENT_DEADLINE_S)
        evs = events(h)
        assert [e.tokens for e in evs if e.kind == "tokens"] == [[5]]  # the prefill's first token went out
        assert evs[-1].kind == "error" and isinstance(evs[-1].error, TimeoutError), evs
        assert decode.time_left and decode.time_left[0] <= CLIENT_DEADLINE_S + SLACK_S, decode.time_left
        assert_nothing_held(router)  # the lease is released before the in-flight count drops
        assert prefill.released == [("exporter-1", 7)]


def test_a_request_without_a_client_deadline_keeps_request_timeout_s():
    """No client deadline (deadline_s None, as the HTTP API and a gRPC client without one submit): the submit's
    timeout_s (how long the caller waits for the request to be taken) is no deadline, and a long generation keeps
    request_timeout_s."""
    prefill, decode = ScriptedPrefill("lease"), SilentDecode()
    with scripted("PrefillWorker", prefill) as p, scripted("DecodeWorker", decode) as d:
        router = make_router([p], [d], info=fake_decode_info())
        h = router.submit(PROMPT, GREEDY, "native", None, timeout_s=1.0)
        try:
            wait_until(lambda: decode.time_left, "the decode call")
            assert decode.time_left[0] > 60.0 - 5.0  # request_timeout_s (60 here) less the prefill's moment
            assert h.deadline - time.monotonic() > 50.0
        finally:
            router.cancel(h)
        assert_nothing_held(router)


# ---- 2. a decode worker's RESOURCE_EXHAUSTED: overloaded, or a prompt it cannot fit ----------------------------
@contextmanager
def overloaded(holder: Holder, address: str) -> Iterator[None]:
    """Take the only RPC slot of the decode worker's server (built with max_rpcs=1): its next call is refused by
    grpcio with RESOURCE_EXHAUSTED, as a worker with every slot streaming would refuse it."""
    c = WorkerClient("prefill", address)
    fut = c.prefill_future(pb.GenerateRequest(version=PROTOCOL_VERSION), 30.0)
    try:
        assert holder.entered.wait(WAIT_S)
        yield
    finally:
        holder.free.set()
        try:
            fut.result(timeout=WAIT_S)
        except grpc.RpcError:
            pass
        c.close()


def test_an_overloaded_decode_worker_is_skipped_for_another(tiny_dir):
    """Worker 0 (picked first) is overloaded: the request is served by worker 1, counted as a retry, and worker 0
    stays in rotation (busy is not gone). The old router answered the client RESOURCE_EXHAUSTED "prompt: ...",
    as if the prompt could never fit."""
    with decode_worker(tiny_dir, max_rpcs=1) as (d0, holder), decode_worker(tiny_dir) as (d1, _):
        router = make_router([], [d0, d1])
        with overloaded(holder, d0):
            h = router.submit(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True), "native", None,
                              timeout_s=30.0)
            evs = events(h)
        assert evs[-1].kind == "done" and evs[-1].finish_reason == "length", evs
        assert sum(len(e.tokens) for e in evs if e.kind == "tokens") == 8
        assert router.retries == 1
        assert all(s.healthy for s in router.pool.slots["decode"])
        assert_nothing_held(router)


def test_an_overloaded_decode_worker_with_no_other_is_reported_as_overload_not_as_the_prompt(tiny_dir):
    """No other decode worker can take it: the client learns the service is overloaded (a status it may retry
    later), not that its prompt is too long (which it must not retry). The worker stays in rotation."""
    with decode_worker(tiny_dir, max_rpcs=1) as (d0, holder):
        router = make_router([], [d0])
        server, port = serve_generation(router)
        try:
            with overloaded(holder, d0):
                h = router.submit(PROMPT, GREEDY, "native", None, timeout_s=30.0)
                err = events(h)[-1]
                with GenerationClient(f"127.0.0.1:{port}") as c, pytest.raises(GenerationError) as got:
                    c.generate_once(PROMPT, timeout_s=30.0, max_tokens=8, method="native", ignore_eos=True)
        finally:
            server.stop(None).wait(5)
        assert err.kind == "error" and isinstance(err.error, Overloaded), err
        assert "overloaded" in str(err.error) and "RESOURCE_EXHAUSTED" in str(err.error), err.error
        e = got.value
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e  # busy: the client may retry (never UNAVAILABLE)
        assert "overloaded" in str(e) and "prompt" not in str(e), e
        assert router.pool.slots["decode"][0].healthy
        assert_nothing_held(router)


def test_a_prompt_a_decode_worker_can_never_fit_stays_a_prompt_error_and_is_not_retried(tiny_dir):
    """Worker 0's KV cache (2 blocks) is smaller than the router believes (its info says 64): it refuses the prompt
    with RESOURCE_EXHAUSTED "prompt: ..." (PromptTooLong). That is the prompt's fault, not load: the client gets
    the prompt error and worker 1 is never asked."""
    with decode_worker(tiny_dir, num_blocks=2) as (d0, _), decode_worker(tiny_dir) as (d1, _):
        router = make_router([], [d0, d1], info=fake_decode_info())
        h = router.submit(PROMPT, SamplingParams(max_tokens=64, ignore_eos=True), "native", None, timeout_s=30.0)
        err = events(h)[-1]
        assert err.kind == "error" and isinstance(err.error, PromptTooLong), err
        assert "KV blocks" in str(err.error) and not str(err.error).startswith("prompt: prompt"), err.error
        assert router.retries == 0 and all(s.healthy for s in router.pool.slots["decode"])
        assert_nothing_held(router)


# ---- 3. counters bumped by many request threads --------------------------------------------------------------


def test_fallback_counts_are_not_lost_between_request_threads(tiny_dir):
    """Request threads count prefill fallbacks at once: unlocked, two read the same count and one increment is
    lost (the metric under-reports faults)."""
    with decode_worker(tiny_dir) as (d, _):
        router = make_router([], [d])
        router.fallbacks = SlowCounter()
        n_threads, each = 8, 25
        go = threading.Barrier(n_threads)

        def bump() -> None:
            go.wait()
            for _ in range(each):
                router._fallback("unavailable", "test")

        threads = [threading.Thread(target=bump) for _ in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert router.fallbacks["unavailable"] == n_threads * each


def test_the_fallback_metric_reads_while_request_threads_add_reasons(tiny_dir):
    """A scrape iterates the counts while a request thread adds a new reason: unlocked, the scrape fails
    ("dictionary changed size during iteration") and the family comes out empty."""
    with decode_worker(tiny_dir) as (d, _):
        router = make_router([], [d])
        router.fallbacks = SlowCounter({f"seen_{i}": 1 for i in range(20)})
        families = {name: fn for name, *_, fn in router.metrics._live.families}
        assert {"flashpd_queue_depth", "flashpd_recompute_fallbacks", "flashpd_decode_retries", "flashpd_workers_healthy",
                "flashpd_worker_restarts", "flashpd_worker_early_crashes"} <= set(families)
        read = families["flashpd_recompute_fallbacks"]
        stop = threading.Event()

        def add() -> None:
            for i in range(40):
                if stop.is_set():
                    return
                router._fallback(f"new_{i}", "test")

        t = threading.Thread(target=add)
        t.start()
        failures, reads = [], 0
        try:
            while t.is_alive() or reads == 0:  # scrapes all the while reasons are added
                reads += 1
                try:
                    values = read()
                    assert len(values) >= 20
                except RuntimeError as e:
                    failures.append(e)
        finally:
            stop.set()
            t.join(WAIT_S)
        assert not failures, failures[:1]


# ---- 4. a request whose thread cannot start ----------------------------------------------------------------
def test_a_request_whose_thread_cannot_start_holds_nothing_and_never_runs_later(tiny_dir, monkeypatch):
    """Starting a request thread can fail (RuntimeError: can't start new thread, under load): submit raises, and
    must not keep the decode slot it picked or the in-flight count; nor may the job it queued run later on another
    request's thread (it would release that slot a second time)."""
    with decode_worker(tiny_dir) as (d, _):
        router = make_router([], [d])
        real_start = threading.Thread.start

        def no_thread(self):
            if self.name == "router-request":
                raise RuntimeError("can't start new thread")
            return real_start(self)

        monkeypatch.setattr(threading.Thread, "start", no_thread)
        with pytest.raises(RuntimeError, match="can't start"):
            router.submit(PROMPT, GREEDY, "native", None, timeout_s=30.0)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert router.inflight == 0 and router.pool.slots["decode"][0].inflight == 0
        for _ in range(2):  # the next requests run normally, and nothing runs twice
            assert events(router.submit(PROMPT, GREEDY, "native", None, timeout_s=30.0))[-1].kind == "done"
        time.sleep(0.2)
        assert_nothing_held(router)


def test_an_idle_request_thread_keeps_no_request_alive():
    """A request thread waiting for its next job must not hold its last one (a handle with the prompt, its event
    queue and calls): with hundreds of threads after a burst, that was one request each kept alive."""
    import weakref

    from flashpd.cluster.router import RequestThreads

    class Job:
        pass

    threads, ran = RequestThreads("idle-check"), threading.Event()
    job = Job()
    ref = weakref.ref(job)
    threads.run(lambda j: ran.set(), job)
    del job
    assert ran.wait(10)
    deadline = time.monotonic() + 10
    while threads._idle == 0 and time.monotonic() < deadline:  # the thread went back to waiting
        time.sleep(0.01)
    time.sleep(0.05)
    assert ref() is None, "the idle thread still holds its last job"

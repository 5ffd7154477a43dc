"""A gRPC server full of requests still answers Health (rpc_guard.CallLimit), and refuses the request past its limit.

Found by a review: grpcio's maximum_concurrent_rpcs counted Health with the requests, so a server at its limit
answered its health probe RESOURCE_EXHAUSTED, which a probe (Kubernetes, a load balancer) reads as down.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from flashpd.cluster.generation_client import GenerationClient, GenerationError
from flashpd.cluster.generation_server import serve_generation
from tests._fake_handle import FakeHandle

LIMIT = 2


class _HeldBackend:
    """Streams one token, then holds every request until `release` is set (no engine)."""

    has_drafter, default_draft_width, vocab_size, max_positions, alive = False, None, 100, 64, True

    def __init__(self) -> None:
        self.release = threading.Event()
        self.cancelled = 0

    def counts(self):
        from flashpd.engine.load import Load
        return Load(running=0, waiting=0, kv_blocks_free=4, kv_blocks_total=4, kv_block_size=16)

    def submit(self, prompt, params, method, draft_width, timeout_s, **_):
        from flashpd.decode_node.engine_loop import Event

        h = FakeHandle()
        h.events.put(Event("tokens", tokens=[7]))

        def finish() -> None:
            self.release.wait(60)
            h.events.put(Event("done", finish_reason="length", stats={"acceptance_lengths": [], "tau": None}))

        threading.Thread(target=finish, daemon=True).start()
        return h

    def cancel(self, h) -> None:
        self.cancelled += 1


@pytest.fixture
def held():
    be = _HeldBackend()
    server, port = serve_generation(be, max_workers=LIMIT)
    client = GenerationClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        yield be, client
    finally:
        be.release.set()
        client.close()
        server.stop(None)


def test_health_is_answered_while_every_request_slot_is_taken(held):
    be, client = held
    streams = [client.generate([5, 6], max_tokens=2, timeout_s=30) for _ in range(LIMIT)]
    first = [next(iter(s)) for s in streams]  # both in flight: each got its first token
    assert all(c.token_ids == [7] for c in first)
    for _ in range(3):
        h = client.health(timeout_s=5)
        assert h["serving"], h
    with pytest.raises(GenerationError) as e:  # one request more is refused for load, at once
        next(iter(client.generate([5, 6], max_tokens=2, timeout_s=10)))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "its limit" in str(e.value), e.value
    be.release.set()
    for s in streams:
        list(s)
    t0 = time.monotonic()
    while True:  # the slots come back as the calls end
        try:
            chunks = list(client.generate([5, 6], max_tokens=2, timeout_s=10))
            break
        except GenerationError as err:
            assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - t0 < 5, err
            time.sleep(0.05)
    assert [t for c in chunks for t in c.token_ids] == [7]


class _SlowSubmitBackend(_HeldBackend):
    """submit itself blocks (as EngineLoop.submit may, up to its timeout), whatever the client does meanwhile."""

    def submit(self, prompt, params, method, draft_width, timeout_s, **kw):
        self.release.wait(3)
        return super().submit(prompt, params, method, draft_width, timeout_s, **kw)


def test_a_handler_still_running_after_its_client_left_keeps_its_slot():
    """Clients that give up (0.3 s deadlines) while their handlers block in submit: the handlers still hold their
    threads, so the limit counts them until they return, and Health keeps its reserve. Counted until the call
    ended, six handlers ran at once on a limit of two, and Health got RESOURCE_EXHAUSTED."""
    be = _SlowSubmitBackend()
    server, port = serve_generation(be, max_workers=LIMIT)
    client = GenerationClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        codes = []
        for _ in range(8):
            try:
                client.generate_once([5, 6], max_tokens=2, timeout_s=0.3)
            except GenerationError as e:
                codes.append(e.code)
        assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 8 - LIMIT  # no handler ran past the limit
        assert client.health(timeout_s=5)["serving"]
    finally:
        be.release.set()
        client.close()
        server.stop(None)


def test_health_is_answered_at_the_limit_under_a_flood_of_refused_calls(held):
    """Clients retrying against a full server: each call past the limit is refused at once, but grpcio counts it
    in flight while it is refused. With grpcio's bound at the threads' count, 8 threads of refused calls took the
    Health reserve and 31% of probes got grpcio's RESOURCE_EXHAUSTED (found by a review)."""
    from flashpd.cluster.generation_client import build_request
    from flashpd.cluster.generation_server import PROTOCOL_VERSION
    from flashpd.cluster.proto_gen import generation_pb2 as pb
    from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc

    be, client = held
    streams = [client.generate([5, 6], max_tokens=2, timeout_s=60) for _ in range(LIMIT)]
    assert all(next(iter(s)).token_ids == [7] for s in streams)  # every slot taken
    address = client.address
    stop, refused, other = threading.Event(), [0], []

    def flood() -> None:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            while not stop.is_set():
                try:
                    stub.GenerateOnce(build_request([5, 6], max_tokens=2), timeout=5)
                    other.append("served")
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "its limit" in (e.details() or ""):
                        refused[0] += 1
                    else:
                        other.append(f"{e.code().name}: {e.details()}")

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    failed = []
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            time.sleep(0.5)
            for _ in range(150):
                try:
                    stub.Health(pb.HealthRequest(version=PROTOCOL_VERSION), timeout=5)
                except grpc.RpcError as e:
                    failed.append(f"{e.code().name}: {e.details()}")
                time.sleep(0.005)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert refused[0] > 100 and not other, (refused[0], other[:3])  # the flood ran, refused by CallLimit only
    assert not failed, (len(failed), failed[:3])
    be.release.set()
    for s in streams:
        list(s)

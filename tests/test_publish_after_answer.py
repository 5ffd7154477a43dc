"""The prefill worker's AwaitPublish over a real gRPC server (cluster/worker_services.py PrefillWorkerServicer) and a
real Publisher (prefill_node/worker.py): a publish's outcome once a ticket (published, or its failure's message),
NOT_FOUND for a ticket awaited or never issued, a caller's deadline that frees the server's thread while the
publish still runs, and a stopping worker's quiesce waiting for the queued publishes. The model is left out: the
Publisher's cache is a stand-in whose store_pending the test scripts."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from flashpd.cluster.generation_server import new_server
from flashpd.cluster.worker_client import WorkerClient
from flashpd.cluster.worker_services import PrefillHost, PrefillWorkerServicer
from flashpd.kv_bridge.prefix_cache import Pending
from flashpd.prefill_node.worker import Publisher


class ScriptedCache:
    """store_pending: returns 3, raises, or waits for `go` (then returns 3), as `mode` says."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.go = threading.Event()

    def store_pending(self, p: Pending) -> int:
        if self.mode == "fail":
            raise ConnectionError("the bridge went away")
        if self.mode == "block":
            self.go.wait(30)
        return 3


def pending() -> Pending:
    return Pending([1, 2, 3], True, [torch.zeros(4, 4)], [torch.zeros(2, 4)])


@pytest.fixture()
def served():
    cache = ScriptedCache()
    pub = Publisher(cache)
    calls = []

    def await_publish(ticket, timeout_s):
        calls.append(time.monotonic())
        return pub.await_(ticket, timeout_s)
    worker = SimpleNamespace(publisher=pub, await_publish=await_publish, exporter=None)
    runner = SimpleNamespace(model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=8)), max_positions=64,
                             allocator=SimpleNamespace(num_free=4), kv_block_size=16)
    host = PrefillHost(worker, runner, None)
    server, port = new_server("127.0.0.1", 0, False, 8, {"PrefillWorker": PrefillWorkerServicer(host)})
    client = WorkerClient("prefill", f"127.0.0.1:{port}")
    try:
        yield cache, pub, host, client, calls
    finally:
        cache.go.set()
        client.close()
        server.stop(None).wait(5)
        pub.close()


def test_a_publish_outcome_comes_back_once_a_ticket(served):
    cache, pub, host, client, _ = served
    ok = pub.submit(pending(), (1,))
    reply = client.await_publish_future(ok, 10).result()
    assert reply.published and reply.published_chunks == 3
    with pytest.raises(grpc.RpcError) as e:  # awaited already
        client.await_publish_future(ok, 10).result()
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    cache.mode = "fail"
    bad = pub.submit(pending(), (1,))
    reply = client.await_publish_future(bad, 10).result()
    assert not reply.published and reply.error == "ConnectionError: the bridge went away"
    assert pub.failures == 1
    with pytest.raises(grpc.RpcError) as e:
        client.await_publish_future(bad + 1_000, 10).result()  # never issued
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_callers_deadline_frees_the_server_while_the_publish_runs_and_quiesce_waits_for_it(served):
    cache, pub, host, client, calls = served
    cache.mode = "block"
    t = pub.submit(pending(), (1,))
    with pytest.raises(grpc.RpcError) as e:
        client.await_publish_future(t, 0.5).result()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.5)
    n = len(calls)
    time.sleep(0.5)
    assert len(calls) == n  # the handler stopped polling once its call ended
    assert host.quiesce(0.2) is False  # a publish still runs
    host._lock.release()  # (quiesce took the runner; a stopping worker keeps it)
    cache.go.set()
    assert host.quiesce(10) is True
    assert pub.await_(t, 10) == 3

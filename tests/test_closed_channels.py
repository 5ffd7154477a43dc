"""A call on a closed channel of flashpd's is a ValueError, never a crash.

grpcio (1.85) makes a call's handle on the channel under an interceptor at each call; on a closed channel that
crashed the whole process (SIGSEGV). Every channel that carries a token has that interceptor: the router's channels
to its workers, the bridge clients'. A worker restart closes the old client while a request that picked the slot
may still call it (cluster/router.py), a pool's stop closes every client under requests in flight, and PrefillStubs
closes the least recently used channel. kv_bridge/rpc_guard._CloseGuard makes close() wait for calls being made, and
later calls raise ChannelClosed: UNAVAILABLE to the router's handlers (a worker gone), and grpc's own ValueError. Real gRPC servers and channels on 127.0.0.1."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.worker_client import WorkerClient

ROOT = Path(__file__).resolve().parents[1]


def test_calls_after_close_raise_value_error_in_a_process_that_survives():
    """In a child process, so that the old crash fails this test rather than the test run: every call kind of a
    token-carrying WorkerClient, and a BridgeClient's, after close()."""
    code = textwrap.dedent("""
        import grpc
        from flashpd.cluster.proto_gen import generation_pb2 as pb
        from flashpd.cluster.worker_client import WorkerClient
        from flashpd.kv_bridge.auth import ClusterSecret
        from flashpd.kv_bridge.client import BridgeClient

        c = WorkerClient("prefill", "127.0.0.1:9", token="t")
        c.close()
        calls = {"health": lambda: c.health(1.0),
                 "prefill": lambda: c.prefill(pb.GenerateRequest(), 1.0),
                 "prefill_future": lambda: c.prefill_future(pb.GenerateRequest(), 1.0).result(),
                 "await_publish_future": lambda: c.await_publish_future(1, 1.0).result()}
        d = WorkerClient("decode", "127.0.0.1:9", token="t")
        d.close()
        calls["decode"] = lambda: list(d.decode(pb.DecodeRequest(), 1.0))
        for name, call in calls.items():
            try:
                call()
                print(name, "no error")
            except grpc.RpcError as e:  # the router's handlers: a worker gone
                print(name, e.code().name, isinstance(e, ValueError), e)
        b = BridgeClient("127.0.0.1:9", secret=ClusterSecret.generate())
        b.close()
        try:
            b.stub.Health
            b.lookup(["k"])
            print("bridge no error")
        except Exception as e:
            print("bridge", type(e).__name__)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    for name in ("health", "prefill", "prefill_future", "await_publish_future", "decode"):
        assert f"{name} UNAVAILABLE True Cannot invoke RPC on closed channel!" in lines, r.stdout
    assert any(line.startswith("bridge ") for line in lines), r.stdout


class _SlowHealth:
    """A PrefillWorker whose Health answers after `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.started = threading.Event()

    def health(self, request: pb.HealthRequest, context) -> pb.HealthReply:
        self.started.set()
        time.sleep(self.delay_s)
        return pb.HealthReply(serving=True, kv_blocks_total=7)


def test_a_close_during_a_call_waits_for_it_and_refuses_the_next():
    svc = _SlowHealth(0.5)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.unary_unary_rpc_method_handler(svc.health, request_deserializer=pb.HealthRequest.FromString,
                                                  response_serializer=pb.HealthReply.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "flashpd.generation.v1.PrefillWorker", {"Health": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        c = WorkerClient("prefill", f"127.0.0.1:{port}", token="t")
        got: dict = {}
        t = threading.Thread(target=lambda: got.setdefault("reply", c.health(10.0)))
        t.start()
        assert svc.started.wait(10.0)
        c.close()  # returns at once; the channel closes when the call in progress returns
        t.join(10.0)
        assert got["reply"]["kv_blocks_total"] == 7
        try:
            c.health(1.0)
            raise AssertionError("a call after close() went through")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and isinstance(e, ValueError)
        c.close()  # twice: nothing more
    finally:
        server.stop(None)

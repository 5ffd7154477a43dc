"""The router's channel to one prefill or decode worker (proto/generation.proto's worker services).

Every channel carries the workers' token (`x-flashpd-token`; ClusterSecret.worker_token, not the bridge's): a
worker's services refuse a call without it (cluster/worker_main.py). With the service's TLS configured
(ServeConfig.tls_*), every channel to a worker is TLS too: else the token crosses the network in the clear."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Sequence

import grpc

from flashpd.cluster.generation_server import PROTOCOL_VERSION
from flashpd.cluster.prefill_claims import CLAIM_HEADER
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc
from flashpd.kv_bridge.handoff import Handoff
from flashpd.kv_bridge.rpc_guard import with_token
from flashpd.kv_bridge.tls import BridgeTls

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 5.0


def health_dict(r: pb.HealthReply) -> dict:
    return {"serving": r.serving, "has_drafter": r.has_drafter, "running": r.running, "waiting": r.waiting,
            "kv_blocks_free": r.kv_blocks_free, "kv_blocks_total": r.kv_blocks_total,
            "kv_block_size": r.kv_block_size, "vocab_size": r.vocab_size, "max_positions": r.max_positions,
            "default_block_size": r.default_block_size or None, "resumes": r.resumes}


def release_request(exporter_id: str, lease_id: int, blocks: Sequence[int], epochs: Sequence[int]) -> pb.ReleaseRequest:
    """A Release naming the lease's blocks and epochs as its handoff gave them: the exporter frees a lease only for
    exactly its own (a lease id alone let a header carrying another request's id free that lease early)."""
    return pb.ReleaseRequest(version=PROTOCOL_VERSION, exporter_id=exporter_id, lease_id=lease_id, blocks=blocks,
                             epochs=epochs)


def _claim_metadata(claim: int | None) -> tuple[tuple[str, str], ...] | None:
    return ((CLAIM_HEADER, str(claim)),) if claim else None


def worker_channel(address: str, token: str | None, tls: BridgeTls | None = None) -> grpc.Channel:
    """A channel to a worker's services, presenting `token` on every call (None: none, for a worker that
    asks for none); TLS verified against tls.ca when `tls` is given (the workers then serve it)."""
    ch = grpc.secure_channel(address, tls.channel_credentials()) if tls is not None else grpc.insecure_channel(address)
    return with_token(ch, token) if token is not None else ch


class WorkerClient:
    def __init__(self, role: str, address: str, token: str | None = None, tls: BridgeTls | None = None) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: must be 'prefill' or 'decode', got {role!r}")
        self.role = role
        self.address = address
        self._channel = worker_channel(address, token, tls)
        self._stub = pb_grpc.PrefillWorkerStub(self._channel) if role == "prefill" else \
            pb_grpc.DecodeWorkerStub(self._channel)

    def health(self, timeout_s: float) -> dict:
        """The worker's HealthReply as a dict; raises grpc.RpcError when it does not answer in time."""
        return health_dict(self._stub.Health(pb.HealthRequest(version=PROTOCOL_VERSION), timeout=timeout_s))

    def prefill_future(self, request: pb.GenerateRequest, timeout_s: float, claim: int | None = None):
        """A cancellable Prefill call (its .result() raises grpc.RpcError on failure). claim: names the lease the
        call makes, for release_claim when its answer never arrives (cluster/prefill_claims.py)."""
        return self._stub.Prefill.future(request, timeout=timeout_s, metadata=_claim_metadata(claim))

    def prefill(self, request: pb.GenerateRequest, timeout_s: float, claim: int | None = None) -> pb.PrefillReply:
        """A blocking Prefill call: faster than a future's, measurably so against TTFT (no hand-off through
        the channel's polling thread: docs/results.md), but a cancel cannot reach it (raises grpc.RpcError
        on failure). claim: as prefill_future's."""
        return self._stub.Prefill(request, timeout=timeout_s, metadata=_claim_metadata(claim))

    def release_claim(self, claim: int, timeout_s: float) -> bool:
        """Free the lease a Prefill call carrying `claim` made, whose answer never arrived (False: none was made
        yet, and it will be freed as it is made; or the decode worker or the deadline freed it already)."""
        return self._stub.Release(pb.ReleaseRequest(version=PROTOCOL_VERSION, claim=claim), timeout=timeout_s).released

    def await_publish_future(self, ticket: int, timeout_s: float):
        """A cancellable wait for a prefill's publish after its answer (.result() raises grpc.RpcError: NOT_FOUND
        for an unknown ticket, DEADLINE_EXCEEDED while it still runs)."""
        return self._stub.AwaitPublish.future(pb.AwaitPublishRequest(version=PROTOCOL_VERSION, ticket=ticket),
                                              timeout=timeout_s)

    def release(self, handoff: pb.Handoff, timeout_s: float) -> bool:
        """Free a device-path lease this worker holds (False: unknown or expired already, or refused: the release
        names the handoff's blocks and epochs, and they are not exactly the lease's)."""
        req = release_request(handoff.exporter_id, handoff.lease_id, handoff.blocks, handoff.epochs)
        return self._stub.Release(req, timeout=timeout_s).released

    def decode(self, request: pb.DecodeRequest, timeout_s: float):
        """The streamed chunks of a Decode call (iterate; .cancel() ends it)."""
        return self._stub.Decode(request, timeout=timeout_s)

    def close(self) -> None:
        self._channel.close()


class PrefillStubs:
    """One channel and PrefillWorker stub per prefill worker address, made on first use (thread-safe); each
    channel presents `token`."""

    MAX_CHANNELS = 64  # a restarted prefill worker comes back at a new port: the least recently used go

    def __init__(self, token: str | None = None, tls: BridgeTls | None = None) -> None:
        self._token, self._tls = token, tls
        self._stubs: OrderedDict[str, tuple[grpc.Channel, pb_grpc.PrefillWorkerStub]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, address: str) -> pb_grpc.PrefillWorkerStub:
        old = None
        with self._lock:
            got = self._stubs.get(address)
            if got is None:
                ch = worker_channel(address, self._token, self._tls)
                got = self._stubs[address] = (ch, pb_grpc.PrefillWorkerStub(ch))
                if len(self._stubs) > self.MAX_CHANNELS:
                    old = self._stubs.popitem(last=False)[1][0]
            else:
                self._stubs.move_to_end(address)
        if old is not None:
            old.close()  # a call still in flight on it ends CANCELLED: a release then waits for the lease deadline
        return got[1]

    def close(self) -> None:
        with self._lock:
            chans, self._stubs = [c for c, _ in self._stubs.values()], {}
        for c in chans:
            c.close()


class LeaseReleaser:
    """Releases device-path leases at their prefill workers without waiting (a decode worker's engine loop
    calls it): a lost release only holds the blocks until the lease's deadline. Counted, logged."""

    def __init__(self, token: str | None = None, tls: BridgeTls | None = None) -> None:
        self.failures = 0
        self._stubs = PrefillStubs(token, tls)
        self._lock = threading.Lock()

    def __call__(self, h: Handoff) -> None:
        if not h.exporter_address:
            return
        req = release_request(h.exporter_id, h.lease_id, h.blocks, h.epochs)
        try:
            fut = self._stubs.get(h.exporter_address).Release.future(req, timeout=RELEASE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001  a release never fails the request
            self._failed(h, e)
            return
        fut.add_done_callback(lambda f: self._done(h, f))

    def _done(self, h: Handoff, f) -> None:
        try:
            e = f.exception()
        except Exception as x:  # noqa: BLE001  cancelled
            e = x
        if e is not None:
            self._failed(h, e)

    def _failed(self, h: Handoff, e: BaseException | None) -> None:
        with self._lock:
            self.failures += 1
        log.warning("releasing lease %d at %s failed (%s); it expires at its deadline", h.lease_id,
                    h.exporter_address, e)

    def close(self) -> None:
        self._stubs.close()

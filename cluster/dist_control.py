"""gRPC control of the cross-host KV path (kv_transport "dist", kv_bridge/dist_transfer.py): the prefill
worker's OpenPair / SendLease handlers and the decode worker's client for them. Only control travels
here; the KV itself goes over the pair's process group (NCCL or gloo)."""
from __future__ import annotations

from typing import Sequence

import grpc

from flashpd.cluster.generation_server import PROTOCOL_VERSION
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc
from flashpd.cluster.worker_client import PrefillStubs
from flashpd.kv_bridge.dist_transfer import DistExporter, PairLost
from flashpd.kv_bridge.handoff import HandoffError
from flashpd.kv_bridge.tls import BridgeTls

CONTROL_MARGIN_S = 5.0  # a SendLease may wait for its pair to form (the exporter's timeout) plus the gather


class DistControlServicer:
    """OpenPair, SendLease and PairStore over a DistExporter (mixed into PrefillWorkerServicer; `dist` None: not served)."""

    dist: DistExporter | None = None

    def _dist_call(self, request, context: grpc.ServicerContext, fn):
        if request.version != PROTOCOL_VERSION:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"version: {request.version} is not supported (this server speaks {PROTOCOL_VERSION})")
        if self.dist is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this prefill worker does not serve kv_transport dist")
        try:
            return fn()
        except PermissionError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        except PairLost as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except HandoffError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def OpenPair(self, request: pb.OpenPairRequest, context: grpc.ServicerContext) -> pb.OpenPairReply:
        def run():
            address, geometry, seal = self.dist.open_pair(request.exporter_id, request.importer_id,
                                                          bytes(request.nonce), bytes(request.seal))
            return pb.OpenPairReply(version=PROTOCOL_VERSION, store_address=address, geometry=geometry, seal=seal)
        return self._dist_call(request, context, run)

    def SendLease(self, request: pb.SendLeaseRequest, context: grpc.ServicerContext) -> pb.SendLeaseReply:
        def run():
            self.dist.send_lease(request.exporter_id, bytes(request.nonce), int(request.lease_id),
                                 list(request.blocks), list(request.epochs), int(request.tag), bytes(request.seal))
            return pb.SendLeaseReply(version=PROTOCOL_VERSION)
        return self._dist_call(request, context, run)


    def PairStore(self, request: pb.PairStoreRequest, context: grpc.ServicerContext) -> pb.PairStoreReply:
        def run():
            value, number, ok, seal = self.dist.pair_store(
                request.exporter_id, bytes(request.nonce), request.op, request.key, bytes(request.value),
                bytes(request.expected), int(request.amount), list(request.keys), float(request.timeout_s),
                bytes(request.seal))
            return pb.PairStoreReply(version=PROTOCOL_VERSION, value=value, number=number, ok=ok, seal=seal)
        return self._dist_call(request, context, run)


class DistControlClient:
    """The importer's side (kv_bridge/dist_transfer.Control): one channel per prefill worker. A refused send
    raises HandoffError (the pair stays); any other failure PairLost (the importer drops the pair)."""

    def __init__(self, timeout_s: float, token: str | None = None, tls: BridgeTls | None = None) -> None:
        self.timeout_s = timeout_s + CONTROL_MARGIN_S
        self._stubs = PrefillStubs(token, tls)

    def _stub(self, address: str) -> pb_grpc.PrefillWorkerStub:
        if not address:
            raise PairLost("the handoff names no exporter address")
        return self._stubs.get(address)

    def _call(self, what: str, fn):
        try:
            return fn()
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            err = HandoffError if code == grpc.StatusCode.FAILED_PRECONDITION else PairLost
            raise err(f"{what}: {code.name if code else 'failed'}: {e.details() if hasattr(e, 'details') else e}") \
                from None

    def open_pair(self, address: str, exporter_id: str, importer_id: str, nonce: bytes,
                  seal: bytes) -> tuple[str, str, bytes]:
        req = pb.OpenPairRequest(version=PROTOCOL_VERSION, exporter_id=exporter_id, importer_id=importer_id,
                                 nonce=nonce, seal=seal)
        r = self._call("OpenPair", lambda: self._stub(address).OpenPair(req, timeout=self.timeout_s))
        return r.store_address, r.geometry, bytes(r.seal)

    def send_lease(self, address: str, exporter_id: str, nonce: bytes, lease_id: int, blocks: Sequence[int],
                   epochs: Sequence[int], tag: int, seal: bytes) -> None:
        req = pb.SendLeaseRequest(version=PROTOCOL_VERSION, exporter_id=exporter_id, nonce=nonce, lease_id=lease_id,
                                  blocks=blocks, epochs=epochs, tag=tag, seal=seal)
        self._call("SendLease", lambda: self._stub(address).SendLease(req, timeout=self.timeout_s))

    def pair_store(self, address: str, exporter_id: str, nonce: bytes, op: str, key: str, value: bytes,
                   expected: bytes, amount: int, keys: Sequence[str], timeout_s: float,
                   seal: bytes) -> tuple[bytes, int, bool, bytes]:
        req = pb.PairStoreRequest(version=PROTOCOL_VERSION, exporter_id=exporter_id, nonce=nonce, op=op, key=key,
                                  value=value, expected=expected, amount=amount, keys=list(keys), timeout_s=timeout_s,
                                  seal=seal)
        r = self._call("PairStore", lambda: self._stub(address).PairStore(req, timeout=timeout_s + self.timeout_s))
        return bytes(r.value), int(r.number), bool(r.ok), bytes(r.seal)

    def close(self) -> None:
        self._stubs.close()

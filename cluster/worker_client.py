"""The router's channel to one prefill or decode worker (proto/generation.proto's worker services)."""
from __future__ import annotations

import grpc

from flashpd.cluster.generation_server import PROTOCOL_VERSION
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc


def health_dict(r: pb.HealthReply) -> dict:
    return {"serving": r.serving, "has_drafter": r.has_drafter, "running": r.running, "waiting": r.waiting,
            "kv_blocks_free": r.kv_blocks_free, "kv_blocks_total": r.kv_blocks_total,
            "kv_block_size": r.kv_block_size, "vocab_size": r.vocab_size, "max_positions": r.max_positions,
            "default_block_size": r.default_block_size or None}


class WorkerClient:
    def __init__(self, role: str, address: str) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: must be 'prefill' or 'decode', got {role!r}")
        self.role = role
        self.address = address
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.PrefillWorkerStub(self._channel) if role == "prefill" else \
            pb_grpc.DecodeWorkerStub(self._channel)

    def health(self, timeout_s: float) -> dict:
        """The worker's HealthReply as a dict; raises grpc.RpcError when it does not answer in time."""
        return health_dict(self._stub.Health(pb.HealthRequest(version=PROTOCOL_VERSION), timeout=timeout_s))

    def prefill_future(self, request: pb.GenerateRequest, timeout_s: float):
        """A cancellable Prefill call (its .result() raises grpc.RpcError on failure)."""
        return self._stub.Prefill.future(request, timeout=timeout_s)

    def decode(self, request: pb.DecodeRequest, timeout_s: float):
        """The streamed chunks of a Decode call (iterate; .cancel() ends it)."""
        return self._stub.Decode(request, timeout=timeout_s)

    def close(self) -> None:
        self._channel.close()

"""Shared helpers for the KV bridge tests (test_kv_bridge_*.py): small random chunks. Not a test module."""
from __future__ import annotations

import os
from pathlib import Path

import grpc
import torch

from flashpd.kv_bridge.auth import ClusterSecret, process_secret
from flashpd.kv_bridge.chunk import KVChunk
from flashpd.kv_bridge.client import BridgeClient
from flashpd.kv_bridge.disk import TAG_NAME
from flashpd.kv_bridge.keys import MethodFingerprint, chunk_keys
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2_grpc as pb_grpc
from flashpd.kv_bridge.rpc_guard import TOKEN_HEADER
from flashpd.kv_bridge.server import serve
from flashpd.kv_bridge.shm import SegmentOwner
from flashpd.kv_bridge.store import MemoryStore
from flashpd.kv_bridge.wire import DEFAULT_FRAME_BYTES

# What every store, server and client built without an explicit secret uses (tests in one process).
SECRET = process_secret()
MAC = SECRET.mac_key

CHUNK_TOKENS = 16
# Small shapes: [layers, 2, T, kv_heads, head_dim]; the drafter has fewer layers than the target.
TARGET_LAYERS, DRAFT_LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 2, 8


def fingerprint(drafter: str = "drafter-a", dtype: str = "bfloat16") -> str:
    return MethodFingerprint(target="target-x", drafter=drafter, target_layer_ids=(1, 3), dtype=dtype).digest()


def make_chunk(key: str, tokens: list[int] | None = None, parent: str = "", fp: str = "fp",
               dtype: torch.dtype = torch.bfloat16, draft: bool = True, seed: int = 0) -> KVChunk:
    """A chunk with random K/V of both halves (no draft half when draft=False: a native method)."""
    tokens = list(range(CHUNK_TOKENS)) if tokens is None else tokens
    g = torch.Generator().manual_seed(seed)
    t = len(tokens)
    tk = torch.randn(TARGET_LAYERS, 2, t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    dk = torch.randn(DRAFT_LAYERS, 2, t, KV_HEADS, HEAD_DIM, generator=g).to(dtype) if draft else None
    return KVChunk(key, parent, fp, tokens, tk, dk)


def prompt_chunks(tokens: list[int], fp: str, dtype: torch.dtype = torch.bfloat16, draft: bool = True,
                  seed: int = 0) -> list[KVChunk]:
    """The chained chunks of a prompt under one method fingerprint (keys from chunk_keys)."""
    keys = chunk_keys(tokens, CHUNK_TOKENS, fp)
    return [make_chunk(k, tokens[i * CHUNK_TOKENS:(i + 1) * CHUNK_TOKENS], keys[i - 1] if i else "", fp, dtype,
                       draft, seed + i) for i, k in enumerate(keys)]


def same(a: KVChunk, b: KVChunk) -> bool:
    """Byte-exact equality of two chunks (both halves, header included)."""
    return a.to_bytes(MAC) == b.to_bytes(MAC)


def flip_byte(data: bytes, index: int) -> bytes:
    b = bytearray(data)
    b[index] ^= 0x40
    return bytes(b)


class BridgeHarness:
    """A bridge server with its own explicit secret on a loopback port, a client holding that secret, and a raw
    stub that sends no token unless a call passes md(). serve_kw go to kv_bridge.server.serve."""

    def __init__(self, store=None, secret: ClusterSecret | None = None, *, timeout_s: float = 10.0,
                 frame_bytes: int = DEFAULT_FRAME_BYTES, max_workers: int = 8, **serve_kw) -> None:
        self.secret = secret or ClusterSecret.generate()
        self.store = store if store is not None else MemoryStore(1 << 28, self.secret)
        self.timeout_s = timeout_s
        self.server, self.port = serve(self.store, max_workers=max_workers, secret=self.secret, **serve_kw)
        self.address = f"127.0.0.1:{self.port}"
        self.client = BridgeClient(self.address, timeout_s, frame_bytes, secret=self.secret)
        self.channel = grpc.insecure_channel(self.address)
        self.raw = pb_grpc.KVBridgeStub(self.channel)

    def md(self, token: str | None = None, owner: SegmentOwner | None = None) -> list[tuple[str, str]]:
        """A raw call's metadata: the token (this bridge's unless given), and the owner key of the SHM Put
        segments the call may name (shm.SegmentOwner), as BridgeClient sends them."""
        return [(TOKEN_HEADER, token if token is not None else self.secret.token),
                *([owner.metadata()] if owner is not None else [])]

    def stop(self) -> None:
        self.client.close()
        self.channel.close()
        self.server.stop(grace=None).wait(self.timeout_s)


def disk_listing(directory: str | Path) -> list[str]:
    """A disk tier directory's files but its tag file (entries and temp files), sorted."""
    return sorted(n for n in os.listdir(directory) if n != TAG_NAME)

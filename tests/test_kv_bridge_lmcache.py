"""The LMCache backend (kv_bridge/lmcache_store.py) on a real LMCache 0.5.3 engine and CPU backend:
both halves packed in one object, MAC verified on every read, wrong method a miss, layout
refusals, whole-entry eviction, concurrent puts, and the store behind a real gRPC bridge.
lmcache is a test requirement: a missing lmcache fails this module, it is never skipped."""
from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
import torch

from flashpd.kv_bridge.client import BridgeClient
from flashpd.kv_bridge.keys import chunk_keys
from flashpd.kv_bridge.lmcache_layout import PackedLayout
from flashpd.kv_bridge.lmcache_store import LMCacheStore
from flashpd.kv_bridge.server import serve

try:
    from tests._kv_bridge_helpers import (CHUNK_TOKENS, DRAFT_LAYERS, HEAD_DIM, KV_HEADS, MAC, TARGET_LAYERS,
                                          fingerprint, flip_byte, make_chunk, prompt_chunks, same)
except ImportError:
    from _kv_bridge_helpers import (CHUNK_TOKENS, DRAFT_LAYERS, HEAD_DIM, KV_HEADS, MAC,  # type: ignore
                                    TARGET_LAYERS, fingerprint, flip_byte, make_chunk, prompt_chunks, same)


def layout(dtype: torch.dtype = torch.bfloat16, draft: bool = True) -> PackedLayout:
    return PackedLayout(TARGET_LAYERS, DRAFT_LAYERS if draft else 0, KV_HEADS, HEAD_DIM, CHUNK_TOKENS, dtype)


@pytest.fixture
def store():
    with LMCacheStore(layout(), 1 << 22) as s:
        yield s


@pytest.mark.parametrize("dtype,draft", [(torch.bfloat16, True), (torch.float32, True), (torch.float32, False)])
def test_round_trip_both_halves_byte_exact(dtype, draft):
    before = multiprocessing.get_start_method(allow_none=True)
    with LMCacheStore(layout(dtype, draft), 1 << 22) as s:
        assert multiprocessing.get_start_method(allow_none=True) == before  # LMCache's "spawn" is undone
        chunks = [make_chunk(f"k{i}", dtype=dtype, draft=draft, seed=i) for i in range(3)]
        assert all(s.put(c) for c in chunks)
        for c in chunks:
            got = s.get(c.key)
            assert got is not None and same(got, c) and (got.draft_kv is not None) == draft
        assert s.stats()["entries"] == 3 and s.stats()["hits"] == 3


def test_building_the_engine_leaves_the_processs_environment_as_it_was(monkeypatch, tmp_path):
    """LMCache's engine sets PROMETHEUS_MULTIPROC_DIR for good; a process started from here would inherit it, and
    prometheus_client would keep its counters in pid-named files a later process with that pid counts on from (a
    Ray prefill worker reported 68 prefills for 32: tests/test_metrics_scrape.py)."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with LMCacheStore(layout(torch.float32, True), 1 << 22):
        assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # the user's own: kept
    with LMCacheStore(layout(torch.float32, True), 1 << 22):
        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path)


def test_lookup_leading_hits_and_wrong_fingerprint_is_a_miss(store):
    tokens = list(range(100, 100 + 4 * CHUNK_TOKENS))
    for c in prompt_chunks(tokens, fingerprint("drafter-a")):
        assert store.put(c)
    keys_a = chunk_keys(tokens, CHUNK_TOKENS, fingerprint("drafter-a"))
    keys_b = chunk_keys(tokens, CHUNK_TOKENS, fingerprint("none"))  # same target, another method
    assert store.lookup(keys_a) == 4 and store.lookup(keys_a[1:]) == 3 and store.lookup([]) == 0
    assert store.lookup(keys_b) == 0 and all(store.get(k) is None for k in keys_b)
    assert store.lookup([keys_a[0], keys_b[1], keys_a[2]]) == 1


@pytest.mark.parametrize("where", ["target", "draft", "header"])
def test_corrupt_object_is_refused_counted_and_dropped(store, where):
    c = make_chunk("k", seed=5)
    store.put(c)
    obj = store.object_tensor("k")
    row = {"target": 0, "draft": TARGET_LAYERS, "header": TARGET_LAYERS + DRAFT_LAYERS}[where]
    obj[1, row].view(torch.uint8).view(-1)[7] ^= 0x10  # one bit of LMCache's buffer rots
    assert store.get("k") is None
    s = store.stats()
    assert (s["corrupt_dropped"], s["misses"], s["hits"], s["entries"]) == (1, 1, 0, 0)
    assert store.lookup(["k"]) == 0
    assert store.put(c) and same(store.get("k"), c)  # a fresh put stores it again


def test_an_object_filed_under_another_key_is_refused(store):
    a, b = make_chunk("a", seed=1), make_chunk("b", seed=2)
    store.put(a)
    store.put(b)
    store.object_tensor("b").copy_(store.object_tensor("a"))  # what a 64-bit hash collision would look like
    assert store.get("b") is None and store.stats()["corrupt_dropped"] == 1
    assert same(store.get("a"), a)


def test_chunks_that_do_not_fit_the_layout_are_refused(store):
    bad = [make_chunk("short", tokens=list(range(CHUNK_TOKENS - 1))),
           make_chunk("native", draft=False),  # no drafter half: an entry has both or does not exist
           make_chunk("fp32", dtype=torch.float32)]
    assert not any(store.put(c) for c in bad)
    s = store.stats()
    assert s["layout_refused"] == 3 and s["entries"] == 0


def test_eviction_drops_whole_entries():
    size = layout().rows * layout().header_capacity
    with LMCacheStore(layout(), 6 * size) as s:
        chunks = [make_chunk(f"k{i}", seed=i) for i in range(24)]
        assert all(s.put(c) for c in chunks)
        held = [c for c in chunks if s.contains(c.key)]
        assert 0 < len(held) < len(chunks) and s.contains(chunks[-1].key)  # the newest stays
        for c in chunks:  # each entry is whole (both halves, verified) or absent: never half
            got = s.get(c.key)
            assert (got is not None and same(got, c)) if c in held else got is None
        assert s.stats()["corrupt_dropped"] == 0


def test_concurrent_puts_of_one_key(store):
    c = make_chunk("same", seed=7)
    barrier = threading.Barrier(6, timeout=10)
    results: list[bool] = []

    def worker() -> None:
        barrier.wait()
        results.append(store.put(c))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [True] * 6
    s = store.stats()
    assert (s["puts"], s["duplicate_puts"], s["entries"]) == (1, 5, 1) and same(store.get("same"), c)


def test_behind_a_real_grpc_bridge(store):
    """The gRPC server over the LMCache store: chunks verify on the way in and on the way out."""
    server, port = serve(store, max_workers=4)
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=10, frame_bytes=4096) as client:
            chunks = prompt_chunks(list(range(3 * CHUNK_TOKENS)), fingerprint())
            assert client.put(chunks).stored == 3
            got = client.get([c.key for c in chunks])
            assert len(got) == 3 and all(same(a, b) for a, b in zip(got, chunks))
            data = make_chunk("bad").to_bytes(MAC)
            s = client.put_bytes([("bad", flip_byte(data, len(data) // 2))])
            assert s.refused_keys == ["bad"] and client.lookup(["bad"]) == 0
            assert client.stats()["store.entries"] == 3
    finally:
        server.stop(grace=None).wait(10)


_FAILED_BUILD = """
import sys, threading
import torch
from flashpd.kv_bridge.lmcache_layout import PackedLayout
from flashpd.kv_bridge.lmcache_store import LMCacheStore
try:
    LMCacheStore(PackedLayout(4, 2, 2, 8, 16, torch.bfloat16), 1 << 50)  # more than any host can pin
except Exception as e:
    print("refused", type(e).__name__, flush=True)
print("left", [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()], flush=True)
"""


def test_a_failed_engine_build_raises_and_lets_the_process_exit():
    """LMCache 0.5.3 starts its storage manager's event loop (a non-daemon thread) before its backends: a CPU
    size the host cannot pin raised, and left that thread running, so the process never exited."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _FAILED_BUILD], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "refused RuntimeError" in p.stdout and "left []" in p.stdout, p.stdout + p.stderr[-2000:]

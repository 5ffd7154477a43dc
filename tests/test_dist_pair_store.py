"""The dist path's pair store (kv_bridge/dist_transfer.py: the exporter's in-memory store per pair, RemotePairStore
on the importer), an exporter and an importer in one process with their control calls made directly, gloo on the
CPU: a group that uses its store after construction (NCCL always, gloo with TORCH_GLOO_LAZY_INIT) still reaches
it; back-to-back transfers are never refused for a send this side has not marked done; every store wait is
bounded and a pair's blocking calls are capped; the names torch's C++ calls reach the Python store."""
from __future__ import annotations

import math
import secrets
import threading
import time

import pytest
import torch
import torch.distributed as dist

from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.dist_transfer import (STORE_WAITERS, STORE_WAITERS_ALL, DistExporter, DistImporter, PairLost,
                                             RemotePairStore, seal)
from flashpd.kv_bridge.handoff import CacheExporter

TARGET = (2, 2, 12, 4, 2, 8)  # [layers, k/v, blocks, kv_block_size, heads, head_dim]
DRAFT = (1, 2, 12, 4, 2, 8)
TIMEOUT_S = 3.0


class _Direct:
    """The control channel without gRPC: each call goes straight to the exporter."""

    def __init__(self, dx: DistExporter) -> None:
        self.dx = dx

    def open_pair(self, address, *args):  # noqa: ARG002
        return self.dx.open_pair(*args)

    def send_lease(self, address, *args):  # noqa: ARG002
        return self.dx.send_lease(*args)

    def pair_store(self, address, *args):  # noqa: ARG002
        return self.dx.pair_store(*args)


@pytest.fixture
def pair_ends():
    import torch.multiprocessing as mp  # noqa: PLC0415

    mp.set_sharing_strategy("file_system")
    mac = ClusterSecret.generate().mac_key
    g = torch.Generator().manual_seed(1)
    target, draft = torch.randn(TARGET, generator=g).share_memory_(), torch.randn(DRAFT, generator=g).share_memory_()
    ex = CacheExporter(target, draft, "fp", mac)
    ex.address = "exporter:1"
    dx = DistExporter(ex, target, draft, mac, "127.0.0.1", timeout_s=TIMEOUT_S)
    imp = DistImporter(torch.zeros(TARGET), torch.zeros(DRAFT), "fp", mac, _Direct(dx), "127.0.0.1",
                       timeout_s=TIMEOUT_S)
    yield dict(ex=ex, dx=dx, imp=imp, mac=mac, target=target)
    imp.close()
    dx.close()


def _fetch_exact(e, blocks: list[int]) -> bool:
    h = e["ex"].lease(blocks, 4 * len(blocks), lambda: None)
    try:
        st = e["imp"].fetch(h)
        return torch.equal(st.bufs[0], e["target"].index_select(2, torch.tensor(blocks)))
    finally:
        e["ex"].release(h.lease_id, h.blocks, h.epochs)


def test_a_group_that_uses_its_store_after_construction_still_reaches_it(pair_ends, monkeypatch):
    """NCCL reads its store at the first send/receive; the Python store was collected by then (only the C++ group
    held it) and every call to it failed ("Tried to call pure virtual function")."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    assert _fetch_exact(pair_ends, [1, 2]) and _fetch_exact(pair_ends, [5])
    assert pair_ends["imp"].stats["failures"] == 0


def test_back_to_back_transfers_are_not_refused(pair_ends):
    """The importer's receive can end before the exporter's sender marks its send done; the next SendLease on the
    pair waits for that (bounded) instead of being refused (a quarter of back-to-back fetches fell back)."""
    for i in range(40):
        assert _fetch_exact(pair_ends, [i % 12, (i + 5) % 12]), i
    assert pair_ends["dx"].stats["refused"] == 0 and pair_ends["imp"].stats["failures"] == 0


def _store(e, nonce: bytes) -> RemotePairStore:
    ex_id, importer = e["ex"].exporter_id, nonce.hex()  # an importer's new pair would replace its old one
    e["dx"].open_pair(ex_id, importer, nonce, seal(e["mac"], "open", ex_id, importer, nonce))
    return RemotePairStore(_Direct(e["dx"]), e["mac"], "exporter:1", ex_id, nonce, TIMEOUT_S)


@pytest.mark.parametrize("timeout_s", [0.0, 1e-4, -1.0, math.nan, math.inf])
def test_a_store_wait_is_bounded_whatever_timeout_it_asks_for(pair_ends, timeout_s):
    """0 is "no timeout" to a store, and so is anything under 1 ms: a get of a key nobody sets held a server thread
    for good."""
    st = _store(pair_ends, secrets.token_bytes(16))
    ex_id = pair_ends["ex"].exporter_id
    fields = (ex_id, st._nonce, "get", "never", b"", b"", 0, [], timeout_s)
    t0 = time.monotonic()
    with pytest.raises(PairLost):
        pair_ends["dx"].pair_store(*fields, seal(pair_ends["mac"], "store", *fields))
    assert time.monotonic() - t0 < TIMEOUT_S + 2.0


def test_a_pairs_blocking_store_calls_are_capped(pair_ends):
    st = _store(pair_ends, b"c" * 16)
    errors: list[str] = []

    def get() -> None:
        try:
            st.get("never")
        except Exception as e:  # noqa: BLE001  (over gRPC both are PairLost: INVALID_ARGUMENT, NOT_FOUND)
            errors.append(str(e))

    threads = [threading.Thread(target=get) for _ in range(STORE_WAITERS + 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S + 5)
    assert sum("waiting already" in e for e in errors) == 3  # refused at once
    assert len(errors) == STORE_WAITERS + 3  # the others at the bound


def test_the_names_torch_calls_reach_the_python_store(pair_ends):
    st = _store(pair_ends, b"k" * 16)
    prefixed = dist.PrefixStore("p", st)  # C++ over the Python store: getNumKeys and deleteKey by those names
    deadline = time.monotonic() + 10
    while not st.check(["0/0"]) and time.monotonic() < deadline:  # the exporter's rank writes its own key
        time.sleep(0.01)
    before = prefixed.num_keys()
    prefixed.set("b", b"2")
    assert prefixed.num_keys() == before + 1 == st.num_keys()
    assert prefixed.delete_key("b") and not st.check(["p/b"])


def test_all_pairs_blocking_store_calls_are_capped_together(pair_ends):
    """Each waiting get holds a server thread of the worker's: across pairs too, at most STORE_WAITERS_ALL wait."""
    n_pairs = STORE_WAITERS_ALL // STORE_WAITERS + 2
    stores = [_store(pair_ends, secrets.token_bytes(16)) for _ in range(n_pairs)]
    errors: list[str] = []

    def get(st) -> None:
        try:
            st.get("never")
        except Exception as e:  # noqa: BLE001  (over gRPC both are PairLost)
            errors.append(str(e))

    threads = [threading.Thread(target=get, args=(st,)) for st in stores for _ in range(STORE_WAITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S + 10)
    assert len(errors) == len(threads)
    assert sum(f"{STORE_WAITERS_ALL} gets or waits" in e for e in errors) == len(threads) - STORE_WAITERS_ALL

"""DistExporter.send_lease serves a request its own lease's blocks only (in one process, no process group: a
stand-in pair records what would be sent). The seal proves only that a cluster member made the request; a
request naming blocks of another lease (another request's prompt KV), a lease that is gone, a block twice, or
epochs other than its lease's is refused before its tag is used, anything is gathered or sent, and every lease
stays as it was."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import flashpd.kv_bridge.dist_transfer as dt
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.dist_transfer import DistExporter, PairLost, seal
from flashpd.kv_bridge.handoff import CacheExporter, HandoffError

TARGET = (2, 2, 8, 4, 2, 8)  # [layers, k/v, blocks, kv_block_size, heads, head_dim]
DRAFT = (1, 2, 8, 4, 2, 8)
NONCE = b"n" * 16


class _Pair:
    """Stands in for a formed PairGroup: records each send."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, list[torch.Tensor]]] = []

    def send(self, bufs, tag: int, timeout_s: float) -> None:  # noqa: ARG002
        self.sent.append((tag, [b.clone() for b in bufs]))

    def close(self) -> None:
        pass


@pytest.fixture
def exporter(monkeypatch):
    import torch.multiprocessing as mp  # noqa: PLC0415

    mp.set_sharing_strategy("file_system")
    mac = ClusterSecret.generate().mac_key
    g = torch.Generator().manual_seed(0)
    target, draft = torch.randn(TARGET, generator=g).share_memory_(), torch.randn(DRAFT, generator=g).share_memory_()
    ex = CacheExporter(target, draft, "fp", mac)
    dx = DistExporter(ex, target, draft, mac)
    pair = dt._ExportPair("importer", threading.Event(), ThreadPoolExecutor(1), dt.dist.HashStore(), group=_Pair())
    pair.ready.set()
    dx._pairs[NONCE] = pair
    gathers: list[list[int]] = []
    real_gather = dt.gather_blocks
    monkeypatch.setattr(dt, "gather_blocks",
                        lambda t, d, blocks: gathers.append(list(blocks)) or real_gather(t, d, blocks))
    yield dict(ex=ex, dx=dx, pair=pair, mac=mac, target=target, draft=draft, gathers=gathers)
    dx.close()


def _send(e, lease_id: int, blocks, epochs, tag: int) -> None:
    blocks, epochs = list(blocks), list(epochs)
    e["dx"].send_lease(e["ex"].exporter_id, NONCE, lease_id, blocks, epochs, tag,
                       seal(e["mac"], "send", e["ex"].exporter_id, NONCE, lease_id, blocks, epochs, tag))
    e["pair"].sender.submit(lambda: None).result()  # the queued send (if any) has run


def test_a_request_for_another_leases_blocks_is_refused_and_nothing_is_sent(exporter):
    e = exporter
    ex, pair = e["ex"], e["pair"]
    ha = ex.lease([1, 2], 8, lambda: None)  # request A's prompt
    hb = ex.lease([5], 4, lambda: None)  # request B's: its importer names A's blocks under B's lease
    gone = ex.lease([6], 4, lambda: None)
    ex.release(gone.lease_id, gone.blocks, gone.epochs)
    epochs_before = ex.epochs.clone()
    forged = [
        (hb.lease_id, ha.blocks, ha.epochs, "does not hold"),  # all of another lease's blocks
        (hb.lease_id, (5, 1), (hb.epochs[0], ha.epochs[0]), "does not hold"),  # its own, and one of another's
        (hb.lease_id, (0,), (0,), "does not hold"),  # a block of no lease at all
        (gone.lease_id, gone.blocks, gone.epochs, "freed before"),  # a released lease
        (999, ha.blocks, ha.epochs, "never given"),  # a lease never given
        (ha.lease_id, (1, 1), (ha.epochs[0],) * 2, "more than once"),  # a gather larger than the lease
        (ha.lease_id, ha.blocks, (7, 7), "epochs are not those"),
    ]
    for tag, (lid, blocks, epochs, why) in enumerate(forged, 1):
        with pytest.raises(HandoffError, match=why) as got:
            _send(e, lid, blocks, epochs, tag)
        assert not isinstance(got.value, PairLost)  # the pair goes on
    assert pair.group.sent == [] and e["gathers"] == []  # nothing gathered, nothing sent
    assert pair.last_tag == 0 and not pair.broken
    assert e["dx"].stats["refused"] == len(forged)
    assert ex.held == 2 and ex.stats["released"] == 1 and torch.equal(ex.epochs, epochs_before)  # leases untouched
    for tag, h in enumerate((hb, ha), 1):  # each lease's own request is served, with its own blocks
        _send(e, h.lease_id, h.blocks, h.epochs, tag)
        idx = torch.tensor(h.blocks)
        got_t, got_d = pair.group.sent[-1][1]
        assert torch.equal(got_t, e["target"].index_select(2, idx))
        assert torch.equal(got_d, e["draft"].index_select(2, idx))
    assert e["gathers"] == [list(hb.blocks), list(ha.blocks)]


def test_a_lease_past_its_deadline_is_refused(exporter):
    e = exporter
    h = e["ex"].lease([3], 4, lambda: None)
    e["ex"]._leases[h.lease_id].deadline = 0.0  # not expired() yet: its blocks are about to be freed
    with pytest.raises(HandoffError, match="past its deadline"):
        _send(e, h.lease_id, h.blocks, h.epochs, 1)
    assert e["pair"].group.sent == [] and e["ex"].held == 1


def test_a_pair_dropped_while_its_group_forms_closes_the_group(exporter, monkeypatch):
    """An importer's new pair replaces its old one while the old one's group is still forming: the drop finds no group
    to close, so the group, once formed, must close itself (it leaked: a process group and its store client)."""
    e = exporter
    gate, made = threading.Event(), []

    class _Forming(_Pair):
        def __init__(self, *args) -> None:  # noqa: ARG002
            super().__init__()
            self.closed = False
            made.append(self)
            assert gate.wait(10)

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(dt, "PairGroup", _Forming)
    dx, ex_id = e["dx"], e["ex"].exporter_id
    first, second = b"a" * 16, b"b" * 16
    for nonce in (first, second):  # the second replaces the first (same importer): the first is dropped
        dx.open_pair(ex_id, "imp-2", nonce, seal(e["mac"], "open", ex_id, "imp-2", nonce))
    gate.set()
    assert dx._pairs[second].ready.wait(10)
    deadline = time.monotonic() + 5
    while not (len(made) == 2 and made[0].closed) and time.monotonic() < deadline:
        time.sleep(0.01)  # the first pair's join thread ends on its own
    assert len(made) == 2 and made[0].closed and not made[1].closed


def test_a_lease_cannot_be_named_by_guessing_its_id(exporter):
    """Lease ids are random, not a count: a cluster member who knows no lease id names none of them by guessing.
    Counted from 1 (and epochs starting at 0), 20 one-block guesses read another request's blocks."""
    e = exporter
    ex = e["ex"]
    victim = ex.lease([3, 6], 8, lambda: None)
    ids = [ex.lease([b], 4, lambda: None).lease_id for b in (0, 1, 2, 4, 5)] + [victim.lease_id]
    assert len(set(ids)) == len(ids) and all(0 < i < 2 ** 63 for i in ids)
    assert sorted(ids) != list(range(min(ids), min(ids) + len(ids)))  # not consecutive
    for tag, lid in enumerate(range(1, 201), 1):  # every small id, with the victim's block at epoch 0
        with pytest.raises(HandoffError):
            _send(e, lid, [3], [0], tag)
    assert e["pair"].group.sent == [] and e["gathers"] == []
    _send(e, victim.lease_id, victim.blocks, victim.epochs, 201)  # its own request is served
    assert len(e["pair"].group.sent) == 1

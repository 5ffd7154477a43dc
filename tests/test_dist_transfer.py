"""The cross-host KV path (kv_bridge/dist_transfer.py) between two real processes, on gloo (NCCL on GPUs runs
the same code). A spawned child is the exporter (a CacheExporter's leases, a DistExporter, the PrefillWorker
gRPC service's OpenPair/SendLease); this process is the importer. One child serves the whole module, in test
order: bit-exact blocks of both halves, refused leases (freed before the send, freed during the gather, another
lease's blocks named), a seal or a pair prefix made without the secret, a replayed OpenPair, importers that die
(pairs evicted, never exhausted), a stalled exporter (bounded), a dead one (bounded)."""
from __future__ import annotations

import dataclasses
import secrets
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from flashpd.kv_bridge import dist_transfer
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.dist_transfer import (STORE_MAX_KEYS, STORE_MAX_VALUE, DistImporter, PairGroup, PairLost,
                                             RemotePairStore, seal)
from flashpd.kv_bridge.handoff import HandoffError

from tests._cluster_helpers import colocated_reference  # noqa: F401  (session fixture)
from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)

TARGET = (2, 2, 8, 4, 2, 8)  # [layers, k/v, blocks, kv_block_size, heads, head_dim]
DRAFT = (1, 2, 8, 4, 2, 8)
TIMEOUT_S = 2.0  # the importer's bound on a pair's formation and on one receive


def _filled(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _exporter(secret_hex: str, conn, port: int = 0) -> None:
    """The child: serve leases of two filled caches until told to stop (or to die mid-send)."""
    import os  # noqa: PLC0415

    from flashpd.cluster.dist_control import DistControlServicer  # noqa: PLC0415
    from flashpd.cluster.generation_server import new_server  # noqa: PLC0415
    from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc  # noqa: PLC0415
    from flashpd.kv_bridge.dist_transfer import DistExporter  # noqa: PLC0415
    from flashpd.kv_bridge.handoff import CacheExporter  # noqa: PLC0415

    mp.set_sharing_strategy("file_system")
    mac = ClusterSecret.from_hex(secret_hex).mac_key
    target, draft = _filled(TARGET, 1).share_memory_(), _filled(DRAFT, 2).share_memory_()
    ex = CacheExporter(target, draft, "fp", mac)

    class Faulty(DistExporter):
        """Faults on demand at the exporter's two seams (one shot each)."""
        after_gather = before_send = None

        def _after_gather(self, lease_id: int) -> None:
            fn, self.after_gather = self.after_gather, None
            if fn is not None:
                fn(lease_id)

        def _before_send(self, tag: int) -> None:
            fn, self.before_send = self.before_send, None
            if fn is not None:
                fn(tag)

    dx = Faulty(ex, target, draft, mac, "127.0.0.1", timeout_s=3.0)

    class Servicer(DistControlServicer, pb_grpc.PrefillWorkerServicer):
        dist = dx

    server, port = new_server("127.0.0.1", port, False, 8, {"PrefillWorker": Servicer()}, exclusive=True)
    ex.address = f"127.0.0.1:{port}"
    given = {}  # lease id -> its handoff: a release names the lease's blocks and epochs too

    def release(lease_id: int) -> bool:
        h = given[lease_id]
        return ex.release(lease_id, h.blocks, h.epochs)

    conn.send(("ready", port))
    while True:
        cmd, arg = conn.recv()
        if cmd == "lease":
            h = ex.lease(arg, len(arg) * TARGET[3], lambda: None)
            given[h.lease_id] = h
            conn.send(h)
        elif cmd == "release":
            conn.send(release(arg))
        elif cmd == "free_during_gather":
            dx.after_gather = release
            conn.send(True)
        elif cmd == "stall":
            dx.before_send = lambda tag, s=arg: time.sleep(s)
            conn.send(True)
        elif cmd == "die":
            dx.before_send = lambda tag: os._exit(17)
            conn.send(True)
        elif cmd == "stats":
            conn.send(dict(dx.stats))
        elif cmd == "max_pairs":
            import flashpd.kv_bridge.dist_transfer as dt  # noqa: PLC0415
            dt.MAX_PAIRS = arg
            conn.send(True)
        elif cmd == "stop":
            server.stop(0)
            return


@pytest.fixture(scope="module")
def peer():
    from flashpd.cluster.dist_control import DistControlClient  # noqa: PLC0415

    secret = ClusterSecret.generate()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_exporter, args=(secret.export_hex(), child_conn), daemon=True)
    proc.start()
    assert conn.poll(60) and conn.recv()[0] == "ready"

    def call(cmd, arg=None):
        conn.send((cmd, arg))
        assert conn.poll(20), f"exporter did not answer {cmd}"
        return conn.recv()

    target, draft = torch.zeros(TARGET[:2] + (10,) + TARGET[3:]), torch.zeros(DRAFT[:2] + (10,) + DRAFT[3:])
    control = DistControlClient(TIMEOUT_S)
    imp = DistImporter(target, draft, "fp", secret.mac_key, control, "127.0.0.1", timeout_s=TIMEOUT_S)
    yield dict(call=call, imp=imp, target=target, draft=draft, proc=proc, secret=secret, control=control)
    imp.close()
    control.close()
    if proc.is_alive():
        try:
            conn.send(("stop", None))
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _check_blocks(peer, src: list[int], dst: list[int]) -> None:
    want_t, want_d = _filled(TARGET, 1), _filled(DRAFT, 2)
    for s, d in zip(src, dst):
        assert torch.equal(peer["target"][:, :, d], want_t[:, :, s])
        assert torch.equal(peer["draft"][:, :, d], want_d[:, :, s])


def test_blocks_of_both_halves_arrive_bit_exact_in_other_blocks(peer):
    imp, call = peer["imp"], peer["call"]
    for src, dst in (([3, 1, 6], [0, 9, 2]), ([7, 0], [4, 5])):  # two transfers over one pair
        h = call("lease", src)
        imp.copy(h, dst)
        assert call("release", h.lease_id) is True
        _check_blocks(peer, src, dst)
    assert imp.stats["imports"] == 2 and imp.stats["pairs_opened"] == 1


def test_a_lease_freed_before_or_during_the_send_is_refused_and_the_pair_goes_on(peer):
    imp, call = peer["imp"], peer["call"]
    peer["target"].zero_()
    h = call("lease", [2, 4])
    call("release", h.lease_id)  # freed before the send: its epochs changed
    with pytest.raises(HandoffError, match="freed before"):
        imp.copy(h, [1, 3])
    h = call("lease", [2, 4])
    call("free_during_gather")  # freed between the gather and the exporter's re-check
    with pytest.raises(HandoffError, match="freed during"):
        imp.copy(h, [1, 3])
    assert not peer["target"].any()  # nothing was received
    h = call("lease", [5])
    imp.copy(h, [8])  # the same pair still works: refusals left nothing in flight
    _check_blocks(peer, [5], [8])
    assert imp.stats["pairs_opened"] == 1


def test_a_send_naming_another_leases_blocks_is_refused_and_every_lease_goes_on(peer):
    """An importer that names request A's blocks under request B's lease (sealed with the cluster key, as any member
    can) reads nothing of A's KV: the exporter refuses (FAILED_PRECONDITION: HandoffError, the pair stays), and
    both leases are still served to their own requests."""
    imp, call = peer["imp"], peer["call"]
    peer["target"].zero_()
    peer["draft"].zero_()
    ha, hb = call("lease", [2, 4]), call("lease", [7])
    before, dropped = call("stats"), imp.stats["pairs_dropped"]
    with pytest.raises(HandoffError, match="does not hold") as got:
        imp.copy(dataclasses.replace(hb, blocks=ha.blocks, epochs=ha.epochs), [1, 3])
    assert not isinstance(got.value, PairLost)
    assert not peer["target"].any() and not peer["draft"].any()  # nothing of A's prompt arrived
    assert call("stats")["refused"] == before["refused"] + 1
    imp.copy(hb, [0])
    imp.copy(ha, [1, 3])
    _check_blocks(peer, [7, 2, 4], [0, 1, 3])
    assert imp.stats["pairs_dropped"] == dropped
    assert call("release", ha.lease_id) is True and call("release", hb.lease_id) is True


def test_fetches_from_several_threads_keep_the_pairs_order_and_write_no_cache_block(peer):
    """The asynchronous form: fetches on threads of their own share one pair (serialized per exporter, so each
    receive matches its own SendLease), receive into staging buffers only (the caches stay untouched), and each
    apply writes its own lease's blocks bit-exact into the blocks it is given."""
    imp, call = peer["imp"], peer["call"]
    peer["target"].zero_()
    peer["draft"].zero_()
    srcs = [[0, 5], [3], [7, 1, 6], [2, 4]]
    dsts = [[9, 0], [4], [1, 8, 2], [3, 5]]
    leases = [call("lease", src) for src in srcs]
    opened, staged, errors = imp.stats["pairs_opened"], {}, []

    def fetch(k: int) -> None:
        try:
            staged[k] = imp.fetch(leases[k])
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=fetch, args=(k,)) for k in range(len(leases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(staged) == len(leases)
    assert not peer["target"].any() and not peer["draft"].any()  # nothing written before the apply
    for k in (2, 0, 3, 1):  # applied in any order, each into its own blocks
        imp.apply(staged[k], dsts[k])
    for src, dst, h in zip(srcs, dsts, leases):
        _check_blocks(peer, src, dst)
        assert call("release", h.lease_id) is True
    assert imp.stats["pairs_opened"] == max(opened, 1)  # one pair in all (opened here when the test runs alone)
    assert imp._exporter_locks == {}  # the per-exporter locks live only while a fetch does


def test_fetches_naming_exporters_that_are_gone_leave_no_lock_behind(peer):
    """A fetch whose exporter id this cluster no longer has (a prefill worker restarted: a new id each start)
    fails, and its per-exporter lock goes with it: the table does not grow with every id ever seen."""
    imp, call = peer["imp"], peer["call"]
    h = call("lease", [1])
    failures = imp.stats["failures"]
    for i in range(20):
        with pytest.raises(HandoffError):
            imp.fetch(dataclasses.replace(h, exporter_id=f"gone-{i}"))
    assert imp.stats["failures"] == failures + 20 and imp._exporter_locks == {}
    assert call("release", h.lease_id) is True


def test_no_pair_without_the_cluster_secret(peer):
    """No OpenPair, and no access to a pair's store, without the secret; and there is no store port to reach: an open
    TCPStore let anyone list a pair's keys and join it in the importer's place, or between the two."""
    control = peer["control"]
    h = peer["call"]("lease", [1])
    addr, other = h.exporter_address, ClusterSecret.generate().mac_key
    nonce = secrets.token_bytes(16)
    with pytest.raises(PairLost, match="UNAUTHENTICATED"):  # an OpenPair sealed with another key
        control.open_pair(addr, h.exporter_id, "intruder", nonce, seal(other, "open", h.exporter_id, "intruder", nonce))
    mac = peer["secret"].mac_key
    store_addr, _, _ = control.open_pair(addr, h.exporter_id, "intruder", nonce,
                                         seal(mac, "open", h.exporter_id, "intruder", nonce))
    assert store_addr == ""  # no store port
    # the pair's store, with the nonce seen on the wire but another key: every op refused
    stranger = RemotePairStore(control, other, addr, h.exporter_id, nonce, 1.0)
    for op in (lambda: stranger.set("0/1", b"x"), lambda: stranger.get("0/0"), lambda: stranger.num_keys()):
        with pytest.raises(PairLost, match="UNAUTHENTICATED"):
            op()
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017  joining as rank 1 with it: refused at its first store op
        PairGroup(stranger, 1, torch.device("cpu"), "127.0.0.1", 1.0)
    assert time.monotonic() - t0 < 5


def test_a_pairs_store_is_bounded_and_its_own(peer):
    """A cluster member's store calls: one pair's store only, a bounded number of keys of bounded size, bounded
    waits, and known ops only; refusals leave the exporter serving."""
    control, mac = peer["control"], peer["secret"].mac_key
    h = peer["call"]("lease", [2])
    addr = h.exporter_address
    nonce = secrets.token_bytes(16)
    control.open_pair(addr, h.exporter_id, "bounded", nonce, seal(mac, "open", h.exporter_id, "bounded", nonce))
    st = RemotePairStore(control, mac, addr, h.exporter_id, nonce, 2.0)
    st.set("k", b"v")
    assert st.get("k") == b"v" and st.check(["k"]) and st.add("n", 3) == 3
    with pytest.raises(PairLost, match="INVALID_ARGUMENT"):
        st.set("big", b"x" * (STORE_MAX_VALUE + 1))
    for i in range(STORE_MAX_KEYS):
        try:
            st.set(f"f{i}", b"1")
        except PairLost:
            break
    with pytest.raises(PairLost, match="holds"):
        st.set("one-more", b"1")
    t0 = time.monotonic()
    with pytest.raises(PairLost):  # a key nobody sets: the wait ends at its bound
        st.get("never")
    assert time.monotonic() - t0 < 2.0 + 3.0
    other = RemotePairStore(control, mac, addr, h.exporter_id, secrets.token_bytes(16), 1.0)
    with pytest.raises(PairLost, match="NOT_FOUND"):  # a pair that was never opened has no store
        other.get("k")
    with pytest.raises(PairLost, match="INVALID_ARGUMENT"):  # an OpenPair nonce of another length
        n2 = b"n" * 200
        control.open_pair(addr, h.exporter_id, "long", n2, seal(mac, "open", h.exporter_id, "long", n2))
    assert peer["call"]("release", h.lease_id) is True


def test_a_handoff_naming_its_exporter_at_another_address_is_refused_and_the_pair_goes_on(peer):
    """The importer keys its pairs by exporter id; a header naming a paired exporter's id at another address would
    have sent that pair's nonce and next tag there. Refused before any call; the pair serves its own exporter on."""
    imp, call = peer["imp"], peer["call"]
    h = call("lease", [4])
    imp.fetch(h)  # the pair with this exporter is open
    assert call("release", h.lease_id) is True
    pair = imp._pairs[h.exporter_id]
    tag, opened = pair.tag, imp.stats["pairs_opened"]
    h2 = call("lease", [5])
    with pytest.raises(HandoffError, match="its pair's is at"):
        imp.fetch(dataclasses.replace(h2, exporter_address="127.0.0.1:1"))
    assert imp._pairs[h.exporter_id] is pair and pair.tag == tag
    imp.fetch(h2)
    assert imp.stats["pairs_opened"] == opened and pair.tag == tag + 1
    assert call("release", h2.lease_id) is True


def test_a_replayed_open_pair_is_refused_and_the_live_pair_goes_on(peer):
    """An OpenPair captured on the wire (its seal verifies) opens nothing a second time: the importer's live pair
    stays, with its tag counter."""
    imp, control, call = peer["imp"], peer["control"], peer["call"]
    h = call("lease", [1])
    imp.copy(h, [2])
    nonce = imp._pairs[h.exporter_id].nonce
    msg = (h.exporter_address, h.exporter_id, imp.importer_id, nonce,
           seal(peer["secret"].mac_key, "open", h.exporter_id, imp.importer_id, nonce))
    before = call("stats")
    with pytest.raises(HandoffError, match="a replay"):
        control.open_pair(*msg)
    after = call("stats")
    assert after["replays_refused"] == before["replays_refused"] + 1
    assert (after["pairs_opened"], after["pairs_dropped"]) == (before["pairs_opened"], before["pairs_dropped"])
    h = call("lease", [4])
    imp.copy(h, [6])  # the same pair, untouched
    _check_blocks(peer, [4], [6])
    assert imp.stats["pairs_opened"] == 1


def test_importers_that_die_never_exhaust_the_exporters_pairs(peer):
    """An importer that dies never reopens under its id; at MAX_PAIRS the least recently used pair goes instead
    of every later OpenPair being refused."""
    from flashpd.cluster.dist_control import DistControlClient  # noqa: PLC0415

    call = peer["call"]
    assert call("max_pairs", 2)
    gone = []
    for _ in range(3):  # each imports once, then is abandoned (as a killed decode worker is)
        control = DistControlClient(TIMEOUT_S)
        t, d = torch.zeros_like(peer["target"]), torch.zeros_like(peer["draft"])
        other = DistImporter(t, d, "fp", peer["secret"].mac_key, control, "127.0.0.1", timeout_s=TIMEOUT_S)
        other.copy(call("lease", [3]), [1])
        assert torch.equal(t[:, :, 1], _filled(TARGET, 1)[:, :, 3])
        gone.append((other, control))
    stats = call("stats")
    assert stats["pairs_evicted"] >= 2
    h = call("lease", [7])
    with pytest.raises(PairLost):  # the module's importer was evicted too (least recently used): this send fails,
        peer["imp"].copy(h, [5])  # a counted fallback (the request recomputes) ...
    call("release", h.lease_id)
    h = call("lease", [7])
    peer["imp"].copy(h, [5])  # ... and its next one reopens a pair and is served
    _check_blocks(peer, [7], [5])
    for other, control in gone:
        other.close()
        control.close()
    assert call("max_pairs", 64)


class _HeldControl:
    """The real control client, with OpenPair held at `gate` (a fetch that is opening its pair)."""

    def __init__(self, control) -> None:
        self.control, self.gate, self.opening = control, threading.Event(), threading.Event()

    def open_pair(self, *args):
        self.opening.set()
        assert self.gate.wait(20)
        return self.control.open_pair(*args)

    def send_lease(self, *args) -> None:
        self.control.send_lease(*args)

    def pair_store(self, *args):
        return self.control.pair_store(*args)


def test_an_importer_closed_while_a_fetch_opens_its_pair_keeps_no_pair(peer):
    """The decode worker closes its importer before the import threads it let go have ended: a fetch that is
    opening its pair then must not form one after the close (it was never closed: a process group leaked) nor
    deliver KV; it fails as a HandoffError, and every pair opened is dropped."""
    call = peer["call"]
    control = _HeldControl(peer["control"])
    t, d = torch.zeros_like(peer["target"]), torch.zeros_like(peer["draft"])
    imp = DistImporter(t, d, "fp", peer["secret"].mac_key, control, "127.0.0.1", timeout_s=TIMEOUT_S)
    h = call("lease", [2])
    got: list = []
    fetch = threading.Thread(target=lambda: got.append(_outcome(imp.fetch, h)))
    fetch.start()
    assert control.opening.wait(10)
    imp.close()
    control.gate.set()
    fetch.join(20)
    assert len(got) == 1 and isinstance(got[0], HandoffError), got
    assert imp.stats["pairs_opened"] == imp.stats["pairs_dropped"]
    with pytest.raises(HandoffError, match="closed"):  # and a fetch after the close opens nothing
        imp.fetch(h)
    assert imp.stats["pairs_opened"] == imp.stats["pairs_dropped"]
    assert call("release", h.lease_id) is True


def test_an_importer_closed_mid_receive_leaves_the_pair_to_its_fetch(peer, monkeypatch):
    """Closed while a fetch receives (the exporter is slow to send): the pair is not torn down under the receive
    (on NCCL an abort under a running receive), the fetch ends within its bound, and the pair goes with it."""
    call = peer["call"]
    t, d = torch.zeros_like(peer["target"]), torch.zeros_like(peer["draft"])
    imp = DistImporter(t, d, "fp", peer["secret"].mac_key, peer["control"], "127.0.0.1", timeout_s=TIMEOUT_S)
    h0 = call("lease", [1])
    imp.copy(h0, [0])  # the pair is formed
    assert call("release", h0.lease_id) is True
    assert call("stall", 1.0)
    h = call("lease", [5])
    got: list = []
    receiving = threading.Event()
    recv = dist_transfer.recv_staged
    monkeypatch.setattr(dist_transfer, "recv_staged", lambda *a: (receiving.set(), recv(*a))[1])
    fetch = threading.Thread(target=lambda: got.append(_outcome(imp.fetch, h)))
    fetch.start()
    assert receiving.wait(10.0)  # SendLease answered; the receive waits for the held send
    time.sleep(0.1)
    imp.close()
    assert imp.stats["pairs_dropped"] == 0 and fetch.is_alive()
    fetch.join(20)
    assert len(got) == 1 and not isinstance(got[0], Exception), got
    assert imp.stats["pairs_opened"] == imp.stats["pairs_dropped"] == 1
    call("release", h.lease_id)


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  the caller asserts on it
        return e


def test_a_stalled_exporter_is_a_bounded_failure_and_a_new_pair_follows(peer):
    imp, call = peer["imp"], peer["call"]
    imp.copy(call("lease", [6]), [7])  # a pair open, whatever ran before (alone, the first copy opened one)
    dropped, opened = imp.stats["pairs_dropped"], imp.stats["pairs_opened"]
    call("stall", 2 * TIMEOUT_S)
    h = call("lease", [6])
    t0 = time.monotonic()
    with pytest.raises(HandoffError, match="receive failed"):
        imp.copy(h, [7])
    assert TIMEOUT_S * 0.9 < time.monotonic() - t0 < TIMEOUT_S + 3
    assert imp.stats["pairs_dropped"] == dropped + 1
    h = call("lease", [6])
    imp.copy(h, [7])  # a new pair (it replaces the old one at the exporter)
    _check_blocks(peer, [6], [7])
    assert imp.stats["pairs_opened"] == opened + 1


def test_an_exporter_dying_mid_transfer_fails_the_import_within_the_bound(peer):
    imp, call = peer["imp"], peer["call"]
    call("die")
    h = call("lease", [3])
    t0 = time.monotonic()
    with pytest.raises(HandoffError):
        imp.copy(h, [0])
    assert time.monotonic() - t0 < TIMEOUT_S + 3
    peer["proc"].join(10)
    assert peer["proc"].exitcode == 17
    with pytest.raises(HandoffError):  # and the next import fails fast too (nobody answers OpenPair)
        imp.copy(h, [0])


def test_local_service_over_the_dist_path_equals_colocated(dflash_pair, colocated_reference):  # noqa: F811
    """`kv_transport: dist` with the prefill and decode workers as local processes (gloo on the CPU): the
    prompts' KV crosses over the pair (counted at the decode worker, no fallback) and outputs and acceptance
    lengths equal the colocated server's."""
    import urllib.request  # noqa: PLC0415

    from flashpd.cluster.service import start_service  # noqa: PLC0415
    from tests._cluster_helpers import run_concurrently, serve_cfg  # noqa: PLC0415

    def metric(address: str, name: str) -> float:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith((name + " ", name + "{")))

    ps, ref = colocated_reference
    idx = [1, 2, 3]  # two DFlash requests and a native one
    svc = start_service(serve_cfg(dflash_pair, "local", prefill_workers=1, decode_workers=1, kv_transport="dist"))
    try:
        got = run_concurrently(svc.address, idx, ps)
        for i in idx:
            assert got[i] == ref[i], f"request {i}: tokens / acceptance lengths differ from colocated"
        dec = svc.pool.slots["decode"][0].launched.metrics_address
        assert metric(dec, "flashpd_handoff_imports_total") == len(idx)
        assert metric(dec, "flashpd_handoff_fallbacks_total") == 0
    finally:
        svc.stop()


def test_an_exporter_back_at_its_address_under_a_new_id_replaces_the_dead_ones_pair():
    """A restarted prefill worker listens at its old address with a new exporter id. The importer opens a pair with
    it and drops the dead one's (whose store socket and group threads it otherwise kept for its whole life)."""
    from flashpd.cluster.dist_control import DistControlClient  # noqa: PLC0415

    secret = ClusterSecret.generate()
    ctx = mp.get_context("spawn")

    def spawn(port: int):
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=_exporter, args=(secret.export_hex(), child_conn, port), daemon=True)
        proc.start()
        assert conn.poll(60)
        ready, bound = conn.recv()
        return proc, conn, bound

    def lease(conn, blocks):
        conn.send(("lease", blocks))
        assert conn.poll(20)
        return conn.recv()

    target, draft = torch.zeros(TARGET[:2] + (10,) + TARGET[3:]), torch.zeros(DRAFT[:2] + (10,) + DRAFT[3:])
    control = DistControlClient(TIMEOUT_S)
    imp = DistImporter(target, draft, "fp", secret.mac_key, control, "127.0.0.1", timeout_s=TIMEOUT_S)
    procs = []
    try:
        proc, conn, port = spawn(0)
        procs.append(proc)
        first = lease(conn, [1])
        imp.copy(first, [0])
        conn.send(("stop", None))
        proc.join(20)
        proc, conn, again = spawn(port)
        procs.append(proc)
        assert again == port
        second = lease(conn, [2])
        assert second.exporter_address == first.exporter_address and second.exporter_id != first.exporter_id
        imp.copy(second, [1])
        assert set(imp._pairs) == {second.exporter_id}
        assert imp.stats["pairs_opened"] == 2 and imp.stats["pairs_dropped"] == 1
        conn.send(("stop", None))
    finally:
        imp.close()
        control.close()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()

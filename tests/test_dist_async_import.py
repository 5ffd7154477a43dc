"""The dist path's import runs off the engine thread (decode_node/scheduler.py): a decode Scheduler with a real
DistImporter, a real prefill worker's CacheExporter + DistExporter (its OpenPair / SendLease gRPC service), gloo
on 127.0.0.1, all in this process (the pair's two ranks on threads of their own).

While one request's blocks are held at the exporter, the running batch steps on; the held request is admitted once
they arrive, with a cold colocated run's tokens and acceptance lengths. A fetch that times out is a counted fallback
(the prompt is computed here, exactly); a request cancelled mid-fetch frees everything and the pair stays in step.
Each lease is released exactly once, and every decode block comes back.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from flashpd.cluster.dist_control import DistControlClient, DistControlServicer
from flashpd.cluster.generation_server import new_server
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc
from flashpd.decode_node.handoff_import import HandoffImport
from flashpd.decode_node.scheduler import Scheduler
from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.sampling import SamplingParams
from flashpd.kv_bridge.dist_transfer import DistExporter, DistImporter
from flashpd.prefill_node.worker import PrefillWorker

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)
from tests.test_handoff import SECRET, _cold, _prefill_side, _prompts, _runner

GATE_S = 60.0  # the longest a held send waits for its test to open the gate


@pytest.fixture(scope="module")
def pair(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    return target, load_drafter(dflash_pair.draft_dir, target)


class GatedExporter(DistExporter):
    """A real DistExporter whose sender thread waits at `gate` before each send (a slow or hung prefill host);
    `sending` tells the test a send is being held."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.sending = threading.Event()

    def _before_send(self, tag: int) -> None:
        self.sending.set()
        self.gate.wait(GATE_S)


@dataclass
class Link:
    """A prefill worker serving the dist path and a decode scheduler importing over it."""

    pw: PrefillWorker
    dx: GatedExporter
    sched: Scheduler
    imp: DistImporter
    released: list[int] = field(default_factory=list)  # lease ids, one entry per release the scheduler made
    closers: list = field(default_factory=list)

    def prefill(self, prompt: list[int], sp: SamplingParams):
        return self.pw.prefill(prompt, sp)


@pytest.fixture
def link(pair):
    made: list[Link] = []

    def make(timeout_s: float) -> Link:
        target, drafter = pair
        pw = _prefill_side(target, drafter)
        caches = (pw.gen.runner.cache.data, pw.gen.drafts.cache.data)
        dx = GatedExporter(pw.exporter, *caches, SECRET.mac_key, "127.0.0.1", timeout_s=timeout_s)

        class Servicer(DistControlServicer, pb_grpc.PrefillWorkerServicer):
            dist = dx

        server, port = new_server("127.0.0.1", 0, False, 8, {"PrefillWorker": Servicer()})
        pw.exporter.address = f"127.0.0.1:{port}"
        sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
        control = DistControlClient(timeout_s)
        imp = DistImporter(sched.runner.cache.data, sched.spec.drafts.cache.data, "fp", SECRET.mac_key, control,
                           "127.0.0.1", timeout_s=timeout_s)
        got = Link(pw, dx, sched, imp)

        def release(h) -> None:  # what LeaseReleaser's RPC does at the prefill worker
            got.released.append(h.lease_id)
            pw.release(h.lease_id, h.blocks, h.epochs)

        sched.handoff = HandoffImport(imp, release)
        got.closers = [dx.gate.set, sched.close, imp.close, control.close, dx.close, lambda: server.stop(0)]
        made.append(got)
        return got

    yield make
    for got in made:
        for close in got.closers:
            close()


def _drain(sched: Scheduler, timeout_s: float = 60.0) -> None:
    t0 = time.monotonic()
    while not sched.idle:
        assert time.monotonic() - t0 < timeout_s, "the scheduler did not go idle"
        sched.step()


def _exact(pair, req, prompt: list[int], sp: SamplingParams) -> None:
    out, acc = _cold(*pair, prompt, sp, req.method)
    assert req.seq.output == out and req.seq.stats.acceptance_lengths == acc, f"request {req.id} is not exact"


def test_the_batch_steps_on_while_a_dist_import_is_held_and_the_import_is_exact(pair, link):
    """A prefill host holding its send: the running requests advance by several steps meanwhile (the old
    synchronous import stopped them at admission for up to the importer's timeout), and the held request is
    admitted once its blocks arrive, equal to a cold colocated run."""
    ln = link(timeout_s=30.0)
    sched = ln.sched
    free0 = sched.runner.allocator.num_free
    sp_other, sp = SamplingParams(max_tokens=60, ignore_eos=True), SamplingParams(max_tokens=24, ignore_eos=True)
    other_ps = _prompts(2, 31)
    others = [sched.add(p, sp_other, "native") for p in other_ps]
    for _ in range(2):
        sched.step()
    held = _prompts(1, 32)[0]
    res = ln.prefill(held, sp)
    ln.dx.gate.clear()
    r = sched.add(held, sp, "dflash", first_token=res.first_token, handoff=res.handoff)
    assert ln.dx.sending.wait(10), "the request's fetch did not start ahead of its admission"
    before = {o.id: len(o.seq.output) for o in others}
    t0 = time.monotonic()
    for _ in range(6):
        sched.step()
    assert time.monotonic() - t0 < 10, "steps waited on the held import"
    assert r in sched.waiting and not r.seq.output
    assert all(len(o.seq.output) >= before[o.id] + 4 for o in others), "the running batch stalled on an import"
    ln.dx.gate.set()
    _drain(sched)
    assert sched.stats.handoff_imports == 1 and not sched.handoff.fallbacks
    assert ln.released == [res.handoff.lease_id]
    assert ln.imp.stats["imports"] == 1 and ln.imp.stats["failures"] == 0
    _exact(pair, r, held, sp)
    for o, p in zip(others, other_ps):
        _exact(pair, o, p, sp_other)
    assert sched.runner.allocator.num_free == free0 and ln.pw.exporter.held == 0


def test_a_fetch_that_times_out_falls_back_exactly_and_others_are_unaffected(pair, link):
    """The exporter answers SendLease but never sends in time: the fetch fails within the importer's bound on its
    thread, the request is admitted as a counted fallback and computed here (exactly), the others (one imported over
    the same pair before) run on exactly, the lease is released once and no decode block leaks. The next request
    opens a new pair and imports."""
    ln = link(timeout_s=30.0)  # pair formation under a generous bound (2 loaded cores); the held fetch's below
    sched = ln.sched
    free0, pfree0 = sched.runner.allocator.num_free, ln.pw.gen.runner.allocator.num_free
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    other_ps, (slow, nxt) = _prompts(2, 41), _prompts(2, 42)
    res0 = ln.prefill(other_ps[1], sp)
    others = [sched.add(other_ps[0], sp, "native"),
              sched.add(other_ps[1], sp, "dflash", first_token=res0.first_token, handoff=res0.handoff)]
    t0 = time.monotonic()
    while sched.stats.handoff_imports < 1:
        assert time.monotonic() - t0 < 30, "the first import was not admitted"
        sched.step()
    ln.imp.timeout_s = 1.5  # the bound the held fetch fails by
    res = ln.prefill(slow, sp)
    ln.dx.sending.clear()
    ln.dx.gate.clear()
    r = sched.add(slow, sp, "dflash", first_token=res.first_token, handoff=res.handoff)
    assert ln.dx.sending.wait(10), "the request's fetch did not start ahead of its admission"
    assert r.handoff_load and r in sched.waiting
    _drain(sched)
    assert sched.stats.handoff_imports == 1
    assert sum(sched.handoff.fallbacks.values()) == 1
    assert any(k.startswith("receive failed") for k in sched.handoff.fallbacks), sched.handoff.fallbacks
    assert ln.released == [res0.handoff.lease_id, res.handoff.lease_id]
    _exact(pair, r, slow, sp)
    for o, p in zip(others, other_ps):
        _exact(pair, o, p, sp)
    assert sched.runner.allocator.num_free == free0
    assert ln.pw.gen.runner.allocator.num_free == pfree0 and ln.pw.exporter.held == 0
    ln.imp.timeout_s = 30.0
    ln.dx.gate.set()
    res2 = ln.prefill(nxt, sp)
    r2 = sched.add(nxt, sp, "dflash", first_token=res2.first_token, handoff=res2.handoff)
    _drain(sched)
    assert sched.stats.handoff_imports == 2 and ln.imp.stats["pairs_opened"] == 2
    assert ln.released == [res0.handoff.lease_id, res.handoff.lease_id, res2.handoff.lease_id]
    _exact(pair, r2, nxt, sp)
    assert sched.runner.allocator.num_free == free0


def test_a_request_cancelled_while_its_fetch_runs_frees_everything_once(pair, link):
    """Cancelled mid-fetch: its lease is released once (at the cancel, never again when the fetch ends), no block
    is held on either side, the fetch's data goes nowhere, and the pair stays in step for the next request."""
    ln = link(timeout_s=30.0)
    sched = ln.sched
    free0, pfree0 = sched.runner.allocator.num_free, ln.pw.gen.runner.allocator.num_free
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    gone, nxt = _prompts(2, 51)
    res = ln.prefill(gone, sp)
    ln.dx.gate.clear()
    r = sched.add(gone, sp, "dflash", first_token=res.first_token, handoff=res.handoff)
    assert ln.dx.sending.wait(10), "the request's fetch did not start ahead of its admission"
    fetch = r.load
    sched.step()
    sched.cancel(r)
    assert ln.released == [res.handoff.lease_id] and r.handoff is None and r.load is None
    assert r.seq.finish_reason == "cancelled" and sched.idle
    ln.dx.gate.set()
    fetch.result(timeout=10)  # received into its own staging buffers, never applied
    sched.step()
    assert ln.released == [res.handoff.lease_id]
    assert sched.runner.allocator.num_free == free0
    assert ln.pw.gen.runner.allocator.num_free == pfree0 and ln.pw.exporter.held == 0
    res2 = ln.prefill(nxt, sp)
    r2 = sched.add(nxt, sp, "dflash", first_token=res2.first_token, handoff=res2.handoff)
    _drain(sched)
    assert sched.stats.handoff_imports == 1 and not sched.handoff.fallbacks
    assert ln.imp.stats["pairs_opened"] == 1 and ln.imp.stats["pairs_dropped"] == 0
    assert ln.released == [res.handoff.lease_id, res2.handoff.lease_id]
    _exact(pair, r2, nxt, sp)
    assert sched.runner.allocator.num_free == free0


@pytest.mark.parametrize("async_import", [True, False])
def test_both_import_forms_equal_a_cold_run(pair, link, async_import):
    """async_import False keeps the synchronous form (received at admission); both import every prompt exactly."""
    ln = link(timeout_s=30.0)
    sched = ln.sched
    sched.async_import = async_import
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ps = _prompts(3, 61)
    reqs, leases = [], []
    for p, m in zip(ps, ("dflash", "native", "dflash")):
        res = ln.prefill(p, sp)
        leases.append(res.handoff.lease_id)
        reqs.append(sched.add(p, sp, m, first_token=res.first_token, handoff=res.handoff))
    assert all(r.handoff_load == async_import for r in reqs)
    _drain(sched)
    assert sched.stats.handoff_imports == 3 and not sched.handoff.fallbacks
    assert sorted(ln.released) == sorted(leases)
    for r, p in zip(reqs, ps):
        _exact(pair, r, p, sp)


def test_a_lease_of_another_prompt_is_refused_before_any_transfer(pair, link):
    """A request carrying another prompt's lease (same length, another digest) falls back without a SendLease: no KV
    crosses the network for it, its lease is released once, and it is computed here exactly."""
    ln = link(timeout_s=30.0)
    sched = ln.sched
    free0 = sched.runner.allocator.num_free
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    mine = _prompts(1, 61)[0]
    theirs = list(reversed(mine))  # same length, another prompt
    res, own = ln.prefill(theirs, sp), ln.prefill(mine, sp)
    ln.pw.release(own.handoff.lease_id, own.handoff.blocks, own.handoff.epochs)  # only its first token is used
    r = sched.add(mine, sp, "dflash", first_token=own.first_token, handoff=res.handoff)
    _drain(sched)
    assert ln.dx.stats["sends"] == 0 and ln.imp.stats["pairs_opened"] == 0
    assert sched.stats.handoff_imports == 0
    assert any(k.startswith("lease of another prompt") for k in sched.handoff.fallbacks), sched.handoff.fallbacks
    assert ln.released == [res.handoff.lease_id]
    _exact(pair, r, mine, sp)
    assert sched.runner.allocator.num_free == free0

"""The same-host device path (kv_bridge/handoff.py): a decode worker copies a prefill worker's blocks.

On the CPU the caches are shared through torch.multiprocessing's file-system strategy, the stand-in of
CUDA IPC; the code path is the same. Outputs and per-step acceptance lengths after a handoff equal a
cold colocated run; every unusable handoff (blocks freed before the import, a forged seal, other
geometry, a dead exporter) is a counted fallback that recomputes the prompt; leases free their blocks on
release or at their deadline.
"""
from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import time

import pytest
import torch

from flashpd.decode_node.handoff_import import HandoffImport
from flashpd.decode_node.scheduler import Scheduler
from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.handoff import CacheExporter, CacheImporter, Handoff, HandoffError
from flashpd.prefill_node.worker import PrefillWorker

from tests._cluster_helpers import colocated_reference  # noqa: F401  (module fixture)
from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)

SECRET = ClusterSecret.generate()


@pytest.fixture(scope="module")
def pair(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    return target, load_drafter(dflash_pair.draft_dir, target)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 126, (int(k),), generator=g).tolist() for k in torch.randint(20, 120, (n,), generator=g)]


def _runner(target, drafter, blocks: int = 256) -> ModelRunner:
    return ModelRunner(target, blocks, 16, taps=tuple(drafter.cfg.target_layer_ids))


def _prefill_side(target, drafter, lease_s: float = 10.0, blocks: int = 256) -> PrefillWorker:
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    worker = PrefillWorker(_runner(target, drafter, blocks), drafter, None)
    caches = (worker.gen.runner.cache.data, worker.gen.drafts.cache.data)
    for t in caches:
        t.share_memory_()
    worker.exporter = CacheExporter(*caches, "fp", SECRET.mac_key, lease_s=lease_s)
    return worker


def _release(pw: PrefillWorker, h: Handoff) -> bool:
    """What a decode worker's Release does at the prefill worker: names the lease's blocks and epochs too."""
    return pw.release(h.lease_id, h.blocks, h.epochs)


def _decode_side(target, drafter, secret: ClusterSecret = SECRET, fingerprint: str = "fp"):
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    released: list[int] = []
    imp = CacheImporter(sched.runner.cache.data, sched.spec.drafts.cache.data, fingerprint, secret.mac_key)
    sched.handoff = HandoffImport(imp, lambda h: released.append(h.lease_id))
    return sched, released


def _cold(target, drafter, prompt, params, method):
    """A colocated run from scratch: the oracle of every handoff."""
    runner = _runner(target, drafter)
    gen = DFlashGenerator(runner, drafter, ()) if method == "dflash" else NativeGenerator(runner)
    s = generate(gen, [prompt], [params])[0]
    return s.output, s.stats.acceptance_lengths


def _drain(sched: Scheduler) -> None:
    for _ in range(10_000):
        if sched.idle:
            return
        sched.step()
    raise AssertionError("not idle")


@pytest.mark.parametrize("method", ["dflash", "native"])
def test_handoff_equals_a_cold_colocated_run_and_frees_the_prefill_blocks(pair, method):
    target, drafter = pair
    pw = _prefill_side(target, drafter)
    free0 = pw.gen.runner.allocator.num_free
    sched, released = _decode_side(target, drafter)
    prompts = _prompts(4, 1)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    reqs, handoffs = [], {}
    for p in prompts:
        res = pw.prefill(p, sp)
        assert res.handoff is not None and res.published_chunks == 0
        handoffs[res.handoff.lease_id] = res.handoff
        reqs.append(sched.add(p, sp, method, first_token=res.first_token, handoff=res.handoff))
    assert pw.gen.runner.allocator.num_free < free0  # held under the leases
    _drain(sched)
    assert sched.stats.handoff_imports == 4 and not sched.handoff.fallbacks
    for lid in released:
        assert _release(pw, handoffs[lid])
    assert pw.gen.runner.allocator.num_free == free0 and pw.exporter.held == 0
    for r, p in zip(reqs, prompts):
        out, acc = _cold(target, drafter, p, sp, method)
        assert r.seq.output == out and r.seq.stats.acceptance_lengths == acc


def test_a_decode_step_waits_while_the_prefill_worker_on_its_device_computes(pair):
    """The GPU-sharing hold: the busy word the exporter sets while it prefills holds the importer's next step
    (bounded), a flag older than the bound is ignored, and the output stays exact."""
    target, drafter = pair
    pw = _prefill_side(target, drafter)
    sched, _ = _decode_side(target, drafter)
    sched.hold_for_prefill_s = 0.4
    p, sp = _prompts(1, 4)[0], SamplingParams(max_tokens=24, ignore_eos=True)
    res = pw.prefill(p, sp)
    assert pw.exporter.busy[0] == 0  # cleared when the prefill ended
    r = sched.add(p, sp, "dflash", first_token=res.first_token, handoff=res.handoff)
    sched.step()  # imports (maps the exporter: same host, so a peer) and takes a first step
    assert sched.handoff.importer.peer_busy(0.4) is False and sched.stats.prefill_holds == 0
    with pw.exporter.computing():  # a prefill in progress on the same device
        assert sched.handoff.importer.peer_busy(0.4)
        t0 = time.perf_counter()
        sched.step()
        held = time.perf_counter() - t0
    assert sched.stats.prefill_holds == 1 and 0.35 < held and sched.stats.prefill_hold_ms >= 350
    pw.exporter.busy[0] = time.monotonic_ns() - int(1e9)  # a worker that died mid-prefill a second ago
    sched.step()
    assert sched.stats.prefill_holds == 1  # stale: not held
    pw.exporter.busy[0] = 0
    _drain(sched)
    assert (r.seq.output, r.seq.stats.acceptance_lengths) == _cold(target, drafter, p, sp, "dflash")


def _run_one(sched: Scheduler, p, sp, first, handoff):
    r = sched.add(p, sp, "dflash", first_token=first, handoff=handoff)
    _drain(sched)
    return r


def test_blocks_freed_before_the_import_are_a_counted_fallback_with_exact_output(pair):
    target, drafter = pair
    pw = _prefill_side(target, drafter)
    sched, _ = _decode_side(target, drafter)
    p, sp = _prompts(1, 2)[0], SamplingParams(max_tokens=30, ignore_eos=True)
    res = pw.prefill(p, sp)
    assert _release(pw, res.handoff)  # the lease ends (say, its deadline) before the decode side copies
    pw.prefill(_prompts(1, 3)[0], sp)  # and another prompt reuses its blocks
    r = _run_one(sched, p, sp, res.first_token, res.handoff)
    assert sched.stats.handoff_imports == 0 and sum(sched.handoff.fallbacks.values()) == 1
    assert "freed" in next(iter(sched.handoff.fallbacks))
    assert (r.seq.output, r.seq.stats.acceptance_lengths) == _cold(target, drafter, p, sp, "dflash")


def _two_leases(target, drafter, seed: int):
    """A prefill side holding the leases of two random 60-token prompts A and B, and a decode side: (prefill side,
    scheduler, its released lease ids, the sampling params, (A, its prefill result), (B, its prefill result))."""
    pw = _prefill_side(target, drafter)
    sched, released = _decode_side(target, drafter)
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randint(0, 126, (60,), generator=g).tolist() for _ in range(2))
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    return pw, sched, released, sp, (a, pw.prefill(a, sp)), (b, pw.prefill(b, sp))


def test_a_lease_of_another_prompt_of_the_same_length_is_refused(pair):
    """The lease names its prompt (prompt_digest): prompt B's lease handed in with prompt A of the same length is a
    counted fallback, and A is computed here, exactly; the lease was only checked for its length before."""
    target, drafter = pair
    pw, sched, released, sp, (a, res_a), (b, res_b) = _two_leases(target, drafter, 4)
    r = _run_one(sched, a, sp, res_a.first_token, res_b.handoff)
    assert sched.stats.handoff_imports == 0 and "another prompt" in next(iter(sched.handoff.fallbacks))
    assert released == [res_b.handoff.lease_id]  # released all the same: the prefill side frees it now
    assert (r.seq.output, r.seq.stats.acceptance_lengths) == _cold(target, drafter, a, sp, "dflash")
    r = _run_one(sched, a, sp, res_a.first_token, res_a.handoff)  # its own lease imports
    assert sched.stats.handoff_imports == 1
    assert (r.seq.output, r.seq.stats.acceptance_lengths) == _cold(target, drafter, a, sp, "dflash")


def test_a_handoff_naming_another_leases_blocks_is_refused(pair):
    """A header with this prompt's lease id and digest but another lease's blocks and epochs (another prompt of the
    same length): the device path read those blocks as this prompt's KV (the dist path's exporter refuses them).
    Refused as a counted fallback, computed here exactly; both leases still serve their own requests."""
    target, drafter = pair
    pw, sched, released, sp, (a, res_a), (b, res_b) = _two_leases(target, drafter, 5)
    forged = dataclasses.replace(res_a.handoff, blocks=res_b.handoff.blocks, epochs=res_b.handoff.epochs)
    r = _run_one(sched, a, sp, res_a.first_token, forged)
    assert sched.stats.handoff_imports == 0 and "does not hold" in next(iter(sched.handoff.fallbacks))
    assert (r.seq.output, r.seq.stats.acceptance_lengths) == _cold(target, drafter, a, sp, "dflash")
    assert _release(pw, forged) is False  # what the decode worker's release did: A's lease names other blocks
    assert _release(pw, res_a.handoff) is True
    r = _run_one(sched, b, sp, res_b.first_token, res_b.handoff)  # B's lease still imports
    assert sched.stats.handoff_imports == 1
    assert (r.seq.output, r.seq.stats.acceptance_lengths) == _cold(target, drafter, b, sp, "dflash")
    assert released == [res_a.handoff.lease_id, res_b.handoff.lease_id]


def test_a_release_naming_other_blocks_leaves_the_lease_live(pair):
    """A release names the lease's blocks and epochs as its handoff gave them, and frees the lease only if they are
    exactly its own: a header carrying lease A's id (with B's blocks, or a subset of A's) freed A before, and A's
    request then recomputed its prompt. Refused and counted; A still imports exactly; A's own release frees it."""
    target, drafter = pair
    pw = _prefill_side(target, drafter)
    ex, free0 = pw.exporter, pw.gen.runner.allocator.num_free
    sched, _ = _decode_side(target, drafter)
    a, b = _prompts(2, 11)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    res_a, res_b = pw.prefill(a, sp), pw.prefill(b, sp)
    ha, hb = res_a.handoff, res_b.handoff
    assert len(ha.blocks) > 1
    for blocks, epochs in ((hb.blocks, hb.epochs), (ha.blocks[:1], ha.epochs[:1]),
                           (ha.blocks, tuple(e + 1 for e in ha.epochs))):
        assert pw.release(ha.lease_id, blocks, epochs) is False
    assert ex.stats["refused_releases"] == 3 and ex.holds(ha.lease_id) and ex.holds(hb.lease_id)
    r = _run_one(sched, a, sp, res_a.first_token, ha)
    assert sched.stats.handoff_imports == 1 and not sched.handoff.fallbacks
    assert (r.seq.output, r.seq.stats.acceptance_lengths) == _cold(target, drafter, a, sp, "dflash")
    assert _release(pw, ha) is True and _release(pw, hb) is True
    assert ex.held == 0 and ex.stats["released"] == 2 and pw.gen.runner.allocator.num_free == free0


def test_fallback_reasons_stay_bounded_however_many_leases_are_refused(pair):
    """A fallback is counted by its reason, and reasons name numbers (lengths, lease ids): each refused lease
    made a key of its own, so a worker's counter grew for as long as it served. Numbers read as N, and past
    MAX_REASONS keys a new reason counts as "other"; every fallback is still counted, every output exact."""
    from flashpd.decode_node.handoff_import import MAX_REASONS

    target, drafter = pair
    pw = _prefill_side(target, drafter)
    sched, released = _decode_side(target, drafter)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    g = torch.Generator().manual_seed(7)
    for n in range(20, 32):  # each request carries the lease of its prompt less its last token
        p = torch.randint(0, 126, (n,), generator=g).tolist()
        want = _cold(target, drafter, p, sp, "dflash")[0]
        r = _run_one(sched, p, sp, want[0], pw.prefill(p[:-1], sp).handoff)
        assert r.seq.output == want
    fb = sched.handoff.fallbacks
    assert sum(fb.values()) == 12 and sched.stats.handoff_imports == 0 and len(released) == 12
    assert dict(fb) == {"lease of N positions for a N-token prompt": 12}
    for i in range(3 * MAX_REASONS):  # reasons without numbers to fold: the keys stop at the bound
        sched.handoff.fallback(f"reason {chr(65 + i % 26)}{chr(65 + i // 26)}")
    assert len(fb) <= MAX_REASONS + 1 and sum(fb.values()) == 12 + 3 * MAX_REASONS


def test_a_forged_seal_or_other_geometry_is_refused_and_recomputed(pair):
    target, drafter = pair
    pw = _prefill_side(target, drafter)
    p, sp = _prompts(1, 4)[0], SamplingParams(max_tokens=24, ignore_eos=True)
    want = _cold(target, drafter, p, sp, "dflash")
    cases = {
        "stranger": _decode_side(target, drafter, secret=ClusterSecret.generate()),  # another cluster's key
        "fingerprint": _decode_side(target, drafter, fingerprint="other"),
    }
    for name, (sched, _) in cases.items():
        res = pw.prefill(p, sp)
        r = _run_one(sched, p, sp, res.first_token, res.handoff)
        assert sum(sched.handoff.fallbacks.values()) == 1, name
        assert (r.seq.output, r.seq.stats.acceptance_lengths) == want, name
        _release(pw, res.handoff)
    # a blob altered after sealing
    sched, _ = _decode_side(target, drafter)
    res = pw.prefill(p, sp)
    bad = bytearray(res.handoff.blob)
    bad[10] ^= 1
    forged = Handoff(**{**res.handoff.__dict__, "blob": bytes(bad)})
    r = _run_one(sched, p, sp, res.first_token, forged)
    assert "MAC" in next(iter(sched.handoff.fallbacks)) and r.seq.output == want[0]


def test_a_blob_under_another_exporters_id_is_refused_and_recomputed(pair):
    """Two prefill workers, both sealed with the cluster's key. After the decode side mapped A's caches, a handoff
    naming A's id with B's blob (B's lease: its blocks and epochs) must not read A's blocks as B's: refused, the
    prompt recomputed. So is B's blob under an id it was not sealed for."""
    target, drafter = pair
    pa, pb = _prefill_side(target, drafter), _prefill_side(target, drafter)
    sched, _ = _decode_side(target, drafter)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    (p1, p2), want = _prompts(2, 41), []
    res = pa.prefill(p1, sp)
    r = _run_one(sched, p1, sp, res.first_token, res.handoff)  # maps A's caches under A's id
    assert sched.stats.handoff_imports == 1 and r.seq.output == _cold(target, drafter, p1, sp, "dflash")[0]
    _release(pa, res.handoff)
    want = _cold(target, drafter, p2, sp, "dflash")
    for fake_id in (pa.exporter.exporter_id, "0" * 32):
        res = pb.prefill(p2, sp)
        forged = Handoff(**{**res.handoff.__dict__, "exporter_id": fake_id})
        n = sum(sched.handoff.fallbacks.values())
        r = _run_one(sched, p2, sp, res.first_token, forged)
        assert sum(sched.handoff.fallbacks.values()) == n + 1, fake_id
        assert (r.seq.output, r.seq.stats.acceptance_lengths) == want, fake_id
        _release(pb, res.handoff)
    assert sched.stats.handoff_imports == 1
    assert any("sealed" in k for k in sched.handoff.fallbacks), sched.handoff.fallbacks


def test_leases_expire_at_their_deadline(pair):
    """A decode worker that dies mid-import never releases: the lease's deadline frees its blocks."""
    target, drafter = pair
    pw = _prefill_side(target, drafter, lease_s=5.0)  # long enough that no prefill's own expire() takes one
    free0 = pw.gen.runner.allocator.num_free
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    t0 = time.monotonic()  # every deadline is at least t0 + 5
    for p in _prompts(3, 5):
        pw.prefill(p, sp)
    t1 = time.monotonic()  # and at most t1 + 5
    assert pw.exporter.held == 3 and pw.gen.runner.allocator.num_free < free0
    assert pw.exporter.expire(now=t0 + 4.9) == 0  # not yet at their deadline
    assert pw.exporter.expire(now=t1 + 5.0) == 3
    assert pw.exporter.held == 0 and pw.gen.runner.allocator.num_free == free0
    assert not pw.release(1, [], [])  # a late release of an expired lease is refused


_CHILD = r'''
import pickle, sys, torch
import torch.multiprocessing as mp
mp.set_sharing_strategy("file_system")
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.handoff import CacheExporter
t = torch.randn(2, 2, 8, 4, 1, 3); t.share_memory_()
d = torch.randn(1, 2, 8, 4, 1, 3); d.share_memory_()
ex = CacheExporter(t, d, "fp", ClusterSecret.from_hex(sys.argv[1]).mac_key)
h = ex.lease([5, 2], 20, lambda: None)
sys.stdout.buffer.write(pickle.dumps((h.__dict__, t[:, :, [5, 2]].clone(), d[:, :, [5, 2]].clone())))
sys.stdout.flush()
if sys.argv[2] == "wait":
    sys.stdin.read()  # alive until the parent has imported
'''


@pytest.mark.parametrize("exporter_alive", [True, False])
def test_import_across_processes_and_from_a_dead_exporter(exporter_alive):
    """Another process's caches are copied bit for bit; once the exporter died, the import either still
    reads its intact segment or fails as a counted HandoffError, never with other bytes."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, SECRET.export_hex(), "wait" if exporter_alive else "exit"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if exporter_alive:
        data = b""
        while True:  # read the whole pickle while the child stays alive
            chunk = proc.stdout.read1(1 << 16)
            data += chunk
            try:
                hd, want_t, want_d = pickle.loads(data)
                break
            except Exception:  # noqa: BLE001  incomplete yet
                assert chunk, "child ended early"
    else:
        data, _ = proc.communicate(timeout=60)
        hd, want_t, want_d = pickle.loads(data)
    t, d = torch.zeros(2, 2, 6, 4, 1, 3), torch.zeros(1, 2, 6, 4, 1, 3)
    imp = CacheImporter(t, d, "fp", SECRET.mac_key)
    try:
        imp.copy(Handoff(**hd), [3, 0])
        assert torch.equal(t[:, :, [3, 0]], want_t) and torch.equal(d[:, :, [3, 0]], want_d)
    except HandoffError:
        assert not exporter_alive and imp.stats["failures"] == 1
    finally:
        if exporter_alive:
            proc.stdin.close()
        proc.wait(30)


def _metric(address: str, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " ") or
               ln.startswith(name + "{"))


def test_local_service_over_the_device_path_equals_colocated(dflash_pair, colocated_reference):  # noqa: F811
    """`kv_transport: device` with the prefill and decode workers as separate local processes: every
    prompt's KV crosses by shared caches (counted at the decode worker), outputs and acceptance lengths
    equal the colocated server's, the prefill worker's blocks all come back, and a killed bridge changes
    none of that."""
    import grpc

    from flashpd.cluster.generation_client import GenerationClient, build_request
    from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc
    from flashpd.cluster.service import start_service
    from tests._cluster_helpers import N_PROMPTS, run_concurrently, serve_cfg, wait_until

    ps, ref = colocated_reference
    svc = start_service(serve_cfg(dflash_pair, "local", prefill_workers=1, decode_workers=1, kv_transport="device"))
    try:
        got = run_concurrently(svc.address, list(range(N_PROMPTS)), ps)
        for i in range(N_PROMPTS):
            assert got[i] == ref[i], f"request {i}: tokens / acceptance lengths differ from colocated"
        assert sum(svc.backend.fallbacks.values()) == 0
        dec = svc.pool.slots["decode"][0].launched.metrics_address
        assert _metric(dec, "flashpd_handoff_imports_total") == N_PROMPTS
        assert _metric(dec, "flashpd_handoff_fallbacks_total") == 0
        pre = svc.pool.slots["prefill"][0]
        all_free = lambda: (lambda h: h["kv_blocks_free"] == h["kv_blocks_total"])(pre.client.health(5))  # noqa: E731
        wait_until(all_free, "the prefill worker's leases to be released", timeout_s=10)
        # the bridge dies: the device path does not need it, outputs stay exact, and the KV still crosses by it
        svc.pool.launcher.kill(svc.pool.slots["bridge"][0].launched)
        got = run_concurrently(svc.address, [1, 2], ps)
        assert got[1] == ref[1] and got[2] == ref[2]
        assert _metric(dec, "flashpd_handoff_imports_total") == N_PROMPTS + 2
        # cancelled while its prefill runs on an idle prefill worker (the router's blocking call, which a cancel
        # cannot stop): the lease its reply carries is released at once, not at its 10 s deadline
        g = torch.Generator().manual_seed(9)
        for delay in (0.02, 0.06):
            with grpc.insecure_channel(svc.address) as ch:
                long_prompt = torch.randint(0, 126, (900,), generator=g).tolist()
                call = pb_grpc.GenerationStub(ch).Generate(build_request(long_prompt, max_tokens=40, method="dflash"),
                                                           timeout=30)
                time.sleep(delay)
                call.cancel()
            wait_until(all_free, "the cancelled request's lease to be released", timeout_s=3)
        with GenerationClient(svc.address) as c:
            assert c.health()["serving"]
    finally:
        svc.stop()

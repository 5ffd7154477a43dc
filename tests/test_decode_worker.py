"""The decode worker: preemption by recompute keeps outputs and acceptance lengths exact, a failed
bridge import falls back to local recompute (counted), and the worker streams through its loop."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from flashpd.decode_node.scheduler import Scheduler
from flashpd.decode_node.worker import DecodeWorker
from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.kv_bridge.client import BridgeClient, RemoteStore
from flashpd.kv_bridge.keys import MethodFingerprint
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.server import serve
from flashpd.kv_bridge.store import MemoryStore
from flashpd.prefill_node.worker import PrefillWorker

from tests._dflash_helpers import dflash_pair, solo_run  # noqa: F401  (dflash_pair: a session fixture)

WAIT_S = 30.0


@pytest.fixture(scope="module")
def pair(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    return target, drafter, tuple(drafter.cfg.target_layer_ids)


def _prompts(n: int, seed: int, lo: int = 40, hi: int = 140) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 126, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def test_preemption_by_recompute_is_exact(pair):
    """24 blocks (384 positions) for 6 requests that need ~600: the scheduler must preempt, and every
    request still gives its solo tokens and acceptance lengths (a seeded sampled one included)."""
    target, drafter, taps = pair
    prompts = _prompts(6, 3)
    methods = ["dflash", "dflash", "native", "dflash", "native", "dflash"]
    params = [SamplingParams(max_tokens=60, ignore_eos=True) for _ in range(6)]
    params[3] = SamplingParams(max_tokens=60, temperature=0.8, seed=11, ignore_eos=True)
    sched = Scheduler(ModelRunner(target, 25, 16, taps=taps), drafter, policy="preempt")
    reqs = [sched.add(p, sp, m) for p, sp, m in zip(prompts, params, methods)]
    streamed: dict[int, list[int]] = {}
    for _ in range(2000):
        if sched.idle:
            break
        for rid, toks in sched.step().new_tokens.items():
            streamed.setdefault(rid, []).extend(toks)
    assert sched.idle
    assert sched.stats.preemptions > 0 and sched.stats.recomputed_tokens > 0
    assert sched.runner.allocator.num_free == 24
    for r, p, sp, m in zip(reqs, prompts, params, methods):
        out, acc = solo_run(pair, p, sp, m)
        assert r.seq.output == out and streamed[r.id] == out, (r.id, r.preemptions)
        assert r.seq.stats.acceptance_lengths == acc, (r.id, r.preemptions)
    assert any(r.preemptions for r in reqs if r.method == "dflash")


def test_preempt_policy_admits_more_than_reserve(pair):
    target, drafter, taps = pair
    prompts = _prompts(8, 4, 20, 40)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    counts = {}
    for policy in ("reserve", "preempt"):
        sched = Scheduler(ModelRunner(target, 41, 16, taps=taps), drafter, policy=policy)
        for p in prompts:
            sched.add(p, params, "dflash")
        sched.step()
        counts[policy] = len(sched.running)
    assert counts["reserve"] == 2 and counts["preempt"] == 8, counts


_HELD: list[socket.socket] = []  # dead addresses' sockets, bound for the process's life


def _dead_address() -> str:
    """An address that refuses connections: bound, never listening (a closed port could be taken by another
    test process's port-0 bind meanwhile)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return f"127.0.0.1:{s.getsockname()[1]}"


def _drain(h) -> tuple[list[int], dict]:
    toks: list[int] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        ev = h.get(1.0)
        if ev is None:
            continue
        if ev.kind == "tokens":
            toks.extend(ev.tokens)
        elif ev.kind == "done":
            return toks, ev.stats
        else:
            raise AssertionError(f"unexpected event {ev}")
    raise AssertionError("request did not finish in time")


def test_decode_worker_imports_from_the_bridge_and_falls_back_when_it_is_gone(pair):
    target, drafter, taps = pair
    fp = MethodFingerprint("t", "d", taps, "float32").digest()
    prompts = _prompts(4, 5, 100, 200)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    server, port = serve(MemoryStore(1 << 28))
    pc = BridgeClient(f"127.0.0.1:{port}", timeout_s=5)
    dc = BridgeClient(f"127.0.0.1:{port}", timeout_s=5)
    dead = BridgeClient(_dead_address(), timeout_s=2)
    workers = []
    try:
        prefill = PrefillWorker(ModelRunner(target, 64, 16, taps=taps), drafter, PrefixCache(RemoteStore(pc), fp, 32))
        firsts = [prefill.prefill(p, params).first_token for p in prompts]
        live = DecodeWorker(ModelRunner(target, 128, 16, taps=taps), drafter, prefix_cache=PrefixCache(RemoteStore(dc), fp, 32))
        gone = DecodeWorker(ModelRunner(target, 128, 16, taps=taps), drafter, prefix_cache=PrefixCache(RemoteStore(dead), fp, 32))
        workers = [live, gone]
        for w in workers:
            for p, f in zip(prompts, firsts):
                toks, stats = _drain(w.submit(p, params, "dflash", first_token=f))
                out, acc = solo_run(pair, p, params, "dflash")
                assert toks == out and stats["acceptance_lengths"] == acc
        assert live.stats()["cache_hit_tokens"] == sum(((len(p) - 1) // 32) * 32 for p in prompts)
        assert live.stats()["import_failures"] == 0
        g = gone.stats()
        assert g["cache_hit_tokens"] == 0 and g["import_failures"] == len(prompts) and g["publish_failures"] == len(prompts)
        assert g["kv_blocks_free"] == g["kv_blocks_total"]
    finally:
        for w in workers:
            w.stop()
        for c in (pc, dc, dead):
            c.close()
        server.stop(grace=None).wait(10)

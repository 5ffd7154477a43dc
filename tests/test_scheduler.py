"""Continuous batching: requests joining and leaving between steps give exactly their solo outputs."""
from __future__ import annotations

import pytest
import torch

from flashpd.engine.scheduler import generate, PromptTooLong, Scheduler
from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)


@pytest.fixture(scope="module")
def pair(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    return target, load_drafter(dflash_pair.draft_dir, target)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 126, (int(k),), generator=g).tolist() for k in torch.randint(3, 160, (n,), generator=g)]


def _solo(target, drafter, prompt, params, method):
    runner = ModelRunner(target, 256, 16, taps=tuple(drafter.cfg.target_layer_ids))
    gen = DFlashGenerator(runner, drafter, ()) if method == "dflash" else NativeGenerator(runner)
    s = generate(gen, [prompt], [params])[0]
    return s.output, s.stats.acceptance_lengths


def _scheduler(target, drafter, blocks: int = 1024) -> Scheduler:
    return Scheduler(ModelRunner(target, blocks, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter)


def test_staggered_arrivals_equal_solo_runs_and_stream_in_order(pair):
    target, drafter = pair
    prompts = _prompts(8, 1)
    methods = ["dflash", "native", "dflash", "dflash", "native", "dflash", "native", "dflash"]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (30, 17, 45, 1, 25, 33, 40, 28)]
    sched = _scheduler(target, drafter)
    reqs, streamed = [], {}
    for i in range(4):
        reqs.append(sched.add(prompts[i], params[i], methods[i]))
    for _ in range(3):
        for rid, toks in sched.step().new_tokens.items():
            streamed.setdefault(rid, []).extend(toks)
    for i in range(4, 8):  # these join a batch already in flight
        reqs.append(sched.add(prompts[i], params[i], methods[i]))
    while not sched.idle:
        for rid, toks in sched.step().new_tokens.items():
            streamed.setdefault(rid, []).extend(toks)
    assert sched.runner.allocator.num_free == 1023 and sched._reserved == 0
    for r, p, sp, m in zip(reqs, prompts, params, methods):
        out, acc = _solo(target, drafter, p, sp, m)
        assert r.seq.output == out and streamed[r.id] == out
        assert r.seq.stats.acceptance_lengths == acc
    assert any(max(r.seq.stats.acceptance_lengths, default=1) > 1 for r in reqs)


def test_admission_waits_for_kv_blocks_and_stays_exact(pair):
    target, drafter = pair
    prompts = _prompts(6, 2)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    need = max(-(-(len(p) + 24 + 16) // 16) for p in prompts)
    sched = _scheduler(target, drafter, blocks=2 * need + 2)  # room for about two requests at a time
    capacity = sched.runner.allocator.num_free
    reqs = [sched.add(p, params, "dflash") for p in prompts]
    saw_waiting = False
    while not sched.idle:
        sched.step()
        assert sum(r.reserved_blocks for r in sched.running) <= capacity  # worst cases always fit
        saw_waiting |= bool(sched.waiting) and bool(sched.running)
    assert saw_waiting
    for r, p in zip(reqs, prompts):
        assert r.seq.output == _solo(target, drafter, p, params, "dflash")[0]


def test_refusals_and_cancellation(pair):
    target, drafter = pair
    sched = _scheduler(target, drafter, blocks=20)
    with pytest.raises(PromptTooLong, match="KV blocks"):
        sched.add([5 + i % 100 for i in range(295)], SamplingParams(max_tokens=64), "dflash")
    with pytest.raises(ValueError, match="method"):
        sched.add([1, 2], SamplingParams(), "eagle")
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add([1, 2], SamplingParams(max_tokens=0))
    vocab = target.cfg.vocab_size
    for bad in ([1, vocab], [-1, 2]):  # ids past the vocabulary failed in the embedding (on a GPU: the process)
        with pytest.raises(ValueError, match="prompt ids"):
            sched.add(bad, SamplingParams(max_tokens=4), "native")
    assert sched.idle
    free = sched.runner.allocator.num_free
    r = sched.add(list(range(5, 40)), SamplingParams(max_tokens=50, ignore_eos=True), "dflash")
    sched.step()
    sched.step()
    assert sched.runner.allocator.num_free < free
    sched.cancel(r)
    assert sched.idle and sched.runner.allocator.num_free == free and r.seq.finish_reason == "cancelled"

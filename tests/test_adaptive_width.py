"""Width policies (engine/width_policy.py) keep DFlash exact: any verify width, chosen any way that does not
look at the step's own drawn guesses, gives native greedy output token for token, and sampled rows keep
the target's distribution.

float32 CPU, the tiny fixture pair: a confidence cut at several thresholds (per-row and batch-shared
widths), fixed caps 4/8/16 (on the device loop and stepwise, and equal to a plain block of that width),
the batch-size rule in a scheduler whose batch grows and shrinks (device-loop steps and cutting steps
mixed), no speculation past a batch size (a cap of 1: the rows step undrafted and draft again when the batch
shrinks, with the draft context a recompute would give), and a chi-square test of sampled rows whose widths
the cut varies.
"""
from __future__ import annotations

import pytest
import torch

from flashpd.engine.recompute import recompute
from flashpd.engine.scheduler import Scheduler, step_undrafted
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.engine.width_policy import BatchWidth, ConfidenceWidth, FixedWidth, parse_width_policy
from tests._dflash_helpers import dflash_engine, dflash_pair, greedy, run_checked  # noqa: F401  (fixtures by name)
from tests.test_dflash_sampling import N_TOKENS, PROMPT, _family_p, exact_joint, tiny  # noqa: F401  (fixture)

LENGTHS = [3, 9, 17, 40, 64, 100, 150, 230]  # batch 8, mixed lengths
MAX_NEW = 40


@pytest.fixture(scope="module")
def batch(dflash_engine):
    g = torch.Generator().manual_seed(77)
    prompts = [torch.randint(0, 126, (n,), generator=g).tolist() for n in LENGTHS]
    return prompts, dflash_engine.native(prompts, MAX_NEW)


def _gen(engine, policy, block: int = 16) -> DFlashGenerator:
    return DFlashGenerator(engine.runner, engine.drafter, (), block, width_policy=policy)


# ---- the rule itself --------------------------------------------------------------------------

def test_confidence_rule_cuts_floors_and_shares():
    pol = ConfidenceWidth(threshold=0.5, min_width=2, window=2, share_batch_width=False)
    conf = [[0.9, 0.8, 0.3, 0.9], [0.1, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]]
    assert pol.choose([[], [], []], [5, 5, 3], conf) == [3, 2, 3]  # cut before 0.3; min width; the row's limit
    assert pol.choose([[], [4, 5], []], [5, 5, 3], conf) == [3, 5, 3]  # recent acceptance (mean 4.5) floors it
    shared = ConfidenceWidth(threshold=0.5, window=0, verify_multiple=1)
    assert shared.choose([[], [], []], [5, 5, 3], conf) == [3, 3, 3]  # the batch's widest, each row's limit
    rounded = ConfidenceWidth(threshold=0.5, window=0)  # T rounds up to a multiple of 4, within the limits
    assert rounded.choose([[], [], []], [5, 5, 3], conf) == [4, 4, 3] and rounded.batch_width([3, 2], [3, 3]) == 3
    assert [shared.cap(b) for b in (1, 8, 9, 16, 17, 64)] == [16, 16, 8, 8, 4, 4]
    assert not shared.cuts(1) and shared.cuts(2)
    assert FixedWidth(8).cap(32) == 8 and not FixedWidth().cuts(64)


def test_policy_text_and_refusals():
    assert parse_width_policy("fixed:8") == FixedWidth(8) and parse_width_policy("fixed") == FixedWidth()
    p = parse_width_policy("confidence:threshold=0.4,cut_from_batch=1,caps=1-16/9-8,window=0,share=0,verify_multiple=2")
    assert p == ConfidenceWidth(0.4, 2, 0, ((1, 16), (9, 8)), 1, False, 2)
    for bad in ("wide", "confidence:speed=2"):
        with pytest.raises(ValueError):
            parse_width_policy(bad)
    with pytest.raises(ValueError):
        ConfidenceWidth(max_width_by_batch=((2, 16),))
    with pytest.raises(ValueError):
        FixedWidth(1)
    off = parse_width_policy("batch:caps=1-16/9-4/65-1")
    assert off == BatchWidth(((1, 16), (9, 4), (65, 1))) and parse_width_policy("batch") == BatchWidth()
    assert [off.cap(b) for b in (1, 8, 9, 64, 65, 128)] == [16, 16, 4, 4, 1, 1]
    assert off.speculates(64) and not off.speculates(65) and not any(off.cuts(b) for b in (1, 65))
    assert not ConfidenceWidth(max_width_by_batch=((1, 16), (9, 1))).cuts(9)  # no cut where nothing is drafted
    for bad in ("batch:caps=2-16", "batch:caps=1-17", "batch:caps=1-16/8", "batch:width=4", "batch:1-16"):
        with pytest.raises(ValueError):
            parse_width_policy(bad)


# ---- greedy exactness -------------------------------------------------------------------------

@pytest.mark.parametrize("threshold,share", [(0.3, True), (0.7, False), (0.95, True), (0.95, False)])
def test_confidence_cut_equals_native_greedy(dflash_engine, batch, threshold, share):
    prompts, native = batch
    gen = _gen(dflash_engine, ConfidenceWidth(threshold=threshold, cut_from_batch=1, share_batch_width=share))
    seqs = run_checked(gen, prompts, [greedy(MAX_NEW)] * len(prompts))
    assert [s.output for s in seqs] == native
    ws = gen.width_stats
    assert ws.cut_steps == ws.steps > 0 and (gen._loop is None or gen._loop.sessions == 0), "every step must cut"
    assert len(ws.widths) >= 2 and 0 <= ws.policy_ms
    if not share:  # rows of one step verified at different widths
        assert len({sum(s.stats.position_drafted) / len(s.stats.acceptance_lengths) for s in seqs}) > 1
    assert max(a for s in seqs for a in s.stats.acceptance_lengths) > 1


def test_confidence_cut_batch1_and_next_to_sampled_rows(dflash_engine, batch):
    prompts, native = batch
    gen = _gen(dflash_engine, ConfidenceWidth(threshold=0.6, cut_from_batch=1, window=3))
    for p, want in list(zip(prompts, native))[1:7:2]:
        assert run_checked(gen, [p], [greedy(MAX_NEW)])[0].output == want
    params = [greedy(MAX_NEW) if i % 2 == 0 else
              SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_k=20, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    seqs = run_checked(gen, prompts, params)
    assert [s.output for s in seqs[::2]] == native[::2]


@pytest.mark.parametrize("width", [4, 8, 16])
def test_fixed_caps_equal_native_and_plain_blocks(dflash_engine, batch, width):
    """FixedWidth(w) under a 16 block runs the device loop at w, and gives exactly the tokens and acceptance
    lengths of a plain block of w (stepwise, too)."""
    prompts, native = batch
    gen = _gen(dflash_engine, FixedWidth(width))
    seqs = run_checked(gen, prompts, [greedy(MAX_NEW)] * len(prompts))
    assert [s.output for s in seqs] == native
    assert gen._loop is not None and gen._loop.sessions == 1
    plain = run_checked(_gen(dflash_engine, None, block=width), prompts, [greedy(MAX_NEW)] * len(prompts))
    assert [s.stats.acceptance_lengths for s in seqs] == [s.stats.acceptance_lengths for s in plain]
    step = _gen(dflash_engine, FixedWidth(width))
    step.device_loop = False
    got = run_checked(step, prompts[:4], [greedy(MAX_NEW)] * 4)
    assert [s.output for s in got] == native[:4] and step.width_stats.steps > 0
    assert all(max(s.stats.acceptance_lengths) <= width for s in got)


def test_no_cut_below_cut_from_batch_takes_the_device_loop(dflash_engine, batch):
    prompts, native = batch
    gen = _gen(dflash_engine, ConfidenceWidth(threshold=0.9, cut_from_batch=2))
    assert run_checked(gen, prompts[:1], [greedy(MAX_NEW)])[0].output == native[0]
    assert gen._loop.sessions == 1 and gen.width_stats.cut_steps == 0


def test_batch_rule_in_a_scheduler_with_a_changing_batch(dflash_engine, batch):
    """Arrivals and finishes move the batch between sizes: below cut_from_batch it steps in the device loop
    at the size's cap, from it through the cut; a native row shares the batch. Every request gives its native
    tokens."""
    prompts, native = batch
    runner = ModelRunner(dflash_engine.target, 512, 16, taps=tuple(dflash_engine.drafter.cfg.target_layer_ids),
                         config=RunnerConfig(compile=False))
    pol = ConfidenceWidth(threshold=0.8, max_width_by_batch=((1, 16), (3, 8), (5, 4)), cut_from_batch=3)
    sched = Scheduler(runner, dflash_engine.drafter, width_policy=pol)
    maxes = [MAX_NEW, 12, 30, MAX_NEW, 20, 25]
    plan = {0: [0, 1], 6: [2, 3, 4], 9: [5]}  # step -> prompts that arrive
    reqs, step = {}, 0
    while plan or not sched.idle:
        for i in plan.pop(step, []):
            reqs[i] = sched.add(prompts[i], greedy(maxes[i]), "native" if i == 4 else "dflash")
        sched.step()
        step += 1
        assert step < 500
    for i, r in reqs.items():
        assert r.seq.output == native[i][:maxes[i]], f"request {i}"
    assert sched.overlapped_steps > 0 and sched.spec.width_stats.cut_steps > 0
    assert set(sched.spec.width_stats.widths) <= set(range(2, 9))  # batches of 3+ never verify past 8
    assert runner.allocator.num_free == 511


def test_no_speculation_past_a_batch_size_in_a_served_batch(dflash_engine, batch):
    """A cap of 1 from 3 DFlash rows: two rows draft (device loop), three more arrive (the five step undrafted,
    the first two writing their pending draft context first), rows finish and the last two draft again. Every
    request gives its native tokens; a native row beside them is not counted in the batch size."""
    prompts, native = batch
    runner = ModelRunner(dflash_engine.target, 512, 16, taps=tuple(dflash_engine.drafter.cfg.target_layer_ids),
                         config=RunnerConfig(compile=False))
    sched = Scheduler(runner, dflash_engine.drafter, width_policy=parse_width_policy("batch:caps=1-16/3-1"))
    maxes = [MAX_NEW, 30, 8, 10, 12, MAX_NEW]
    plan = {0: [0, 1], 3: [2, 3, 4, 5]}  # step -> prompts that arrive (5: native)
    reqs, step, undrafted_at = {}, 0, []
    while plan or not sched.idle:
        for i in plan.pop(step, []):
            reqs[i] = sched.add(prompts[i], greedy(maxes[i]), "native" if i == 5 else "dflash")
        before = sched.stats.undrafted_row_steps
        sched.step()
        undrafted_at.append(sched.stats.undrafted_row_steps > before)
        step += 1
        assert step < 500
    for i, r in reqs.items():
        assert r.seq.output == native[i][:maxes[i]], f"request {i}"
    first, last = undrafted_at.index(True), len(undrafted_at) - 1 - undrafted_at[::-1].index(True)
    assert sched.overlapped_steps > 0 and first > 0 and last < step - 2  # drafted before, undrafted, drafted after
    assert sched.stats.undrafted_row_steps >= 3 * (last - first + 1) - 2
    al = reqs[0].seq.stats.acceptance_lengths
    assert 1 + sum(al) == MAX_NEW and max(al[-4:]) > 1, al  # drafting resumed, and pays
    assert runner.allocator.num_free == 511


def test_undrafted_steps_keep_the_draft_context(dflash_engine, batch):
    """After drafted and undrafted steps in turn, a row's draft context (every position's K/V in each draft
    layer) equals what a recompute of its tokens writes, and its tokens are native's."""
    prompts, native = batch
    drafter = dflash_engine.drafter
    runner = ModelRunner(dflash_engine.target, 64, 16, taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(compile=False))
    gen = DFlashGenerator(runner, drafter, (), 16)
    s = gen.new_sequences([prompts[3]], [greedy(MAX_NEW)])[0]
    s.draft_width = 16
    gen.reserve([s])
    gen.prefill_request([s])
    for undrafted in (False, True, True, False, True):
        step_undrafted(gen, [s]) if undrafted else gen.spec_step([s])
    assert s.pending is None and s.draft_len == s.table.num_tokens and s.output == native[3][:len(s.output)]
    ref = gen.new_sequences([prompts[3]], [greedy(MAX_NEW)])[0]
    ref.output = list(s.output)
    recompute(gen, [ref], taps=True)
    n = s.draft_len
    assert ref.draft_len == n
    cache = gen.drafts.cache.data  # [layers, 2, blocks, bs, kv, d]
    slot = lambda q, pos: (q.table.blocks[pos // 16], pos % 16)  # noqa: E731
    got = torch.stack([cache[:, :, b, o] for b, o in (slot(s, i) for i in range(n))])
    want = torch.stack([cache[:, :, b, o] for b, o in (slot(ref, i) for i in range(n))])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for q in (s, ref):
        runner.allocator.free(q.table)


# ---- sampled rows -----------------------------------------------------------------------------

def test_sampled_rows_with_cut_widths_follow_the_target(tiny):  # noqa: F811
    """Rows cut at different widths per step (per row, from the draft's confidence) still sample the target:
    chi-square of every position and adjacent pair against the enumerated joint, as test_dflash_sampling does."""
    n = 2000
    joint = exact_joint(tiny["hf"], PROMPT, N_TOKENS, 1.0, 1.0, 0)
    pol = ConfidenceWidth(threshold=0.2, cut_from_batch=1, window=0, share_batch_width=False)
    gen = DFlashGenerator(tiny["runner"], tiny["drafter"], draft_width=4, width_policy=pol)
    params = [SamplingParams(max_tokens=N_TOKENS, temperature=1.0, seed=7000 + i, ignore_eos=True) for i in range(n)]
    seqs = run_checked(gen, [PROMPT] * n, params)
    drafted = [sum(s.stats.position_drafted[k] for s in seqs if len(s.stats.position_drafted) > k) for k in range(3)]
    steps = sum(len(s.stats.acceptance_lengths) for s in seqs)
    assert drafted[0] == steps and steps * 0.2 < drafted[1] < steps * 0.9, (drafted, steps)  # widths vary
    p_family, tests = _family_p(torch.tensor([s.output for s in seqs]), joint)
    assert p_family > 0.01, f"cut-width samples do not follow the target distribution: {tests}"


# ---- serving ----------------------------------------------------------------------------------

def test_a_served_decode_worker_takes_the_configs_width_policy(dflash_pair, batch):  # noqa: F811
    """`draft_width_policy` in the serve config reaches the decode worker's scheduler (build_decode, as every
    mode builds it), and requests served under a confidence cut give their native tokens."""
    from flashpd.cluster.config import ServeConfig
    from flashpd.cluster.metrics import Metrics
    from flashpd.cluster.worker_main import build_decode, load_model
    from tests.test_decode_worker import _drain

    prompts, native = batch
    spec = "confidence:threshold=0.8,cut_from_batch=1"
    cfg = ServeConfig(target=str(dflash_pair.target_dir), draft=str(dflash_pair.draft_dir), device="cpu",
                      dtype="float32", kv_cache_tokens=4096, draft_width_policy=spec)
    worker = build_decode(cfg, load_model(cfg), None, Metrics("test"))
    try:
        assert worker.scheduler.spec.width_policy == parse_width_policy(spec)
        handles = [worker.submit(prompts[i], greedy(16), "dflash") for i in (1, 3)]
        assert [_drain(h)[0] for h in handles] == [native[1][:16], native[3][:16]]
        assert worker.scheduler.spec.width_stats.cut_steps > 0
    finally:
        worker.stop(10)
    with pytest.raises(ValueError, match="draft_width_policy"):
        ServeConfig(target="t", draft_width_policy="widest")

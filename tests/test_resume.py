"""A request resumed after its worker died: queued with the output the client already has, it is recomputed as a
preempted request is and continues exactly where that output stops (greedy and seeded, native and DFlash, its
acceptance lengths those of the uninterrupted run's later steps); output that already ends the request is refused.
Float32 on the CPU, the fixture pair, against the uninterrupted run of a solo generator."""
from __future__ import annotations

import pytest
import torch

from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import Scheduler

from tests._dflash_helpers import dflash_pair, solo_run  # noqa: F401  (dflash_pair: a session fixture)


@pytest.fixture(scope="module")
def pair(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    return target, drafter, tuple(drafter.cfg.target_layer_ids)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 126, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drain(sched: Scheduler) -> dict[int, list[int]]:
    streamed: dict[int, list[int]] = {}
    for _ in range(2000):
        if sched.idle:
            return streamed
        for rid, toks in sched.step().new_tokens.items():
            streamed.setdefault(rid, []).extend(toks)
    raise AssertionError("the scheduler did not finish")


@pytest.mark.parametrize("method,temperature", [("dflash", 0.0), ("dflash", 0.8), ("native", 0.0), ("native", 0.8)])
def test_a_resumed_request_continues_exactly_where_its_output_stops(pair, method, temperature):
    """Cut where a dead worker's stream stops (after its first token and some steps, a DFlash verify step's
    tokens arriving together), the resumed request streams the rest of the uninterrupted run, and only that."""
    target, drafter, taps = pair
    prompt = _prompt(7, 90)
    params = SamplingParams(max_tokens=70, temperature=temperature, seed=5 if temperature else None, ignore_eos=True)
    out, acc = solo_run(pair, prompt, params, method)
    steps = 3
    cut = 1 + sum(acc[:steps]) if method == "dflash" else 1 + steps
    assert 1 < cut < len(out) - 5
    sched = Scheduler(ModelRunner(target, 64, 16, taps=taps), drafter)
    free = sched.runner.allocator.num_free
    r = sched.add(prompt, params, method, resumed=out[:cut])
    assert r.seq.output == out[:cut] and r.emitted == cut and r.seq.resumed == cut
    streamed = _drain(sched)
    assert streamed[r.id] == out[cut:] and r.seq.output == out and r.seq.finish_reason == "length"
    assert sched.stats.recomputed_tokens == len(prompt) + cut - 1
    if method == "dflash":
        assert r.seq.stats.acceptance_lengths == acc[steps:]
    assert sched.runner.allocator.num_free == free


def test_finish_of_and_resumed_output_that_ends_the_request_is_refused(pair):
    target, drafter, taps = pair
    sched = Scheduler(ModelRunner(target, 64, 16, taps=taps), drafter, stop_ids=(7,))
    p = SamplingParams(max_tokens=5)
    assert sched.finish_of(p, [1, 2]) is None
    assert sched.finish_of(p, [1, 2, 7]) == "stop"
    assert sched.finish_of(SamplingParams(max_tokens=5, ignore_eos=True), [1, 2, 7]) is None
    assert sched.finish_of(p, [1, 2, 3, 4, 5]) == "length"
    prompt = _prompt(3, 30)
    with pytest.raises(ValueError, match="ends the request already"):
        sched.add(prompt, p, "dflash", resumed=[1, 7])
    with pytest.raises(ValueError, match="ends the request already"):
        sched.add(prompt, p, "native", resumed=[1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="first_token"):
        sched.add(prompt, p, "native", first_token=3, resumed=[1])
    released = []
    sched._release_lease = released.append  # a lease handed in with a refused request goes back at once
    with pytest.raises(ValueError, match="handoff: not with resumed output"):
        sched.add(prompt, p, "native", handoff="lease", resumed=[1])
    assert released == ["lease"]
    with pytest.raises(ValueError, match="resumed output ids"):
        sched.add(prompt, p, "native", resumed=[1, target.cfg.vocab_size])
    assert not sched.waiting and sched.idle  # a refusal queues nothing


def test_a_rolled_back_step_of_a_resumed_request_leaves_its_stats(pair):
    """A batch fault rolls a row back to the tokens it streamed, and with them the stats of the steps it takes out
    (they run again). A resumed request's output starts with tokens no step of this worker made: the rollback
    must count them so, or the rolled-back step's acceptance length stayed and was counted twice."""
    from flashpd.engine.scheduler import _rollback

    target, drafter, taps = pair
    prompt = _prompt(9, 80)
    params = SamplingParams(max_tokens=70, ignore_eos=True)
    out, _ = solo_run(pair, prompt, params, "dflash")
    sched = Scheduler(ModelRunner(target, 64, 16, taps=taps), drafter)
    r = sched.add(prompt, params, "dflash", resumed=out[:10])
    while len(r.seq.stats.acceptance_lengths) < 3:
        sched.step()
    acc = list(r.seq.stats.acceptance_lengths)
    assert 10 + sum(acc) == len(r.seq.output)
    r.emitted = len(r.seq.output) - acc[-1]  # as if the last step's tokens had not gone out: it runs again
    _rollback(r)
    assert r.seq.stats.acceptance_lengths == acc[:-1] and len(r.seq.output) == 10 + sum(acc[:-1])

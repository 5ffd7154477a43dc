"""One request fails alone: a fault while serving one request fails only that request, frees its blocks,
and leaves every other request's tokens and acceptance lengths those of an undisturbed run.

Faults are injected by the tests into one generator or store object (wrapping its method on the
instance), never through a hook in the engine: a prefix-cache store that raises for one prompt, a
batch step that raises whenever one request's row is in it, and a step that raises once for all.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flashpd.decode_node.engine_loop import EngineLoop
from flashpd.decode_node.scheduler import Scheduler as DecodeScheduler
from flashpd.engine import scheduler as scheduler_mod
from flashpd.engine.scheduler import MAX_BATCH_FAULTS, generate, RequestFailed, Scheduler
from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.handoff import Handoff, prompt_digest
from flashpd.kv_bridge.keys import chunk_keys
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.store import MemoryStore
from flashpd.prefill_node.worker import PrefillWorker

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)

BLOCKS = 512


@pytest.fixture(scope="module")
def pair(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    return target, load_drafter(dflash_pair.draft_dir, target)


def _prompts(n: int, seed: int, lo: int = 20, hi: int = 90) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 126, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def _runner(target, drafter, blocks: int = BLOCKS) -> ModelRunner:
    return ModelRunner(target, blocks, 16, taps=tuple(drafter.cfg.target_layer_ids))


def _solo_seq(target, drafter, prompt, params, method):
    runner = _runner(target, drafter, 256)
    gen = DFlashGenerator(runner, drafter, ()) if method == "dflash" else NativeGenerator(runner)
    return generate(gen, [prompt], [params])[0]


def _solo(target, drafter, prompt, params, method):
    s = _solo_seq(target, drafter, prompt, params, method)
    return s.output, s.stats.acceptance_lengths


def _positions(s) -> tuple[list[int], list[int]]:
    """A sequence's per-position acceptance counts: a step rolled back and run again must count once."""
    return s.stats.position_accepts, s.stats.position_drafted


def _run(sched: Scheduler, reqs, streamed: dict | None = None, steps: int = 10_000) -> tuple[dict, dict]:
    """Step to idle (or `steps` steps); (streamed tokens by request id, failures by request id)."""
    streamed = {} if streamed is None else streamed
    for r in reqs:
        streamed.setdefault(r.id, [])
    failed: dict[int, RequestFailed] = {}
    for _ in range(steps):
        if sched.idle:
            return streamed, failed
        res = sched.step()
        for rid, toks in res.new_tokens.items():
            streamed[rid].extend(toks)
        for r, err in res.failed:
            failed[r.id] = err
    if steps == 10_000:
        raise AssertionError("scheduler did not go idle")
    return streamed, failed


def _check_others_exact(target, drafter, reqs, prompts, params, methods, streamed, bad: set[int]) -> None:
    for r, p, sp, m in zip(reqs, prompts, params, methods):
        if r.id in bad:
            continue
        solo = _solo_seq(target, drafter, p, sp, m)
        assert r.seq.finish_reason == "length"
        assert streamed[r.id] == solo.output == r.seq.output, f"request {r.id} ({m}) differs from its solo run"
        assert r.seq.stats.acceptance_lengths == solo.stats.acceptance_lengths, f"request {r.id}: acceptances differ"
        assert _positions(r.seq) == _positions(solo), f"request {r.id}: per-position acceptance differs"


def _rows_raise_for(gen, method_name: str, bad_prompt: list[int]) -> None:
    """Make gen's batch step raise whenever the row of bad_prompt is in it (alone too)."""
    orig = getattr(gen, method_name)

    def faulty(seqs, *a, **kw):
        if any(s.prompt == bad_prompt for s in seqs):
            raise RuntimeError("injected fault in one row")
        return orig(seqs, *a, **kw)

    setattr(gen, method_name, faulty)


@pytest.mark.parametrize("method", ["native", "dflash"])
def test_a_row_that_faults_in_every_step_fails_alone(pair, method):
    target, drafter = pair
    prompts = _prompts(5, 3)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 25, 33, 50, 28)]
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    sched.overlap = False  # the stepwise path: the fault sits in its step function
    free0 = sched.runner.allocator.num_free
    reqs = [sched.add(p, sp, method) for p, sp in zip(prompts[:3], params[:3])]
    early, _ = _run(sched, reqs, steps=2)
    _rows_raise_for(sched.spec if method == "dflash" else sched.native,
                    "spec_step" if method == "dflash" else "decode_step", prompts[1])
    reqs += [sched.add(p, sp, method) for p, sp in zip(prompts[3:], params[3:])]  # join a running batch
    streamed, failed = _run(sched, reqs, early)
    assert set(failed) == {reqs[1].id}
    assert "injected fault" in str(failed[reqs[1].id])
    assert reqs[1].seq.finish_reason == "error"
    assert sched.stats.failed_requests == 1 and sched.stats.batch_faults >= 1
    assert sched.runner.allocator.num_free == free0 and not sched._suspects
    _check_others_exact(target, drafter, reqs, prompts, params, [method] * 5, streamed, {reqs[1].id})


def test_rows_that_fault_one_after_another_never_fail_a_bystander(pair):
    """Each faulty row is found by its solo step and failed; the rows that passed alone beside it are cleared,
    so a long request that meets more than MAX_BATCH_FAULTS faulty neighbours in turn still finishes exactly."""
    target, drafter = pair
    prompts = _prompts(1 + MAX_BATCH_FAULTS + 1, 11)
    long, short = SamplingParams(max_tokens=100, ignore_eos=True), SamplingParams(max_tokens=20, ignore_eos=True)
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    sched.overlap = False
    free0 = sched.runner.allocator.num_free
    reqs = [sched.add(prompts[0], long, "native")]
    streamed, failed = _run(sched, reqs, steps=2)
    bad = prompts[1:]
    orig = sched.native.decode_step

    def faulty(seqs, *a, **kw):
        if any(s.prompt in bad for s in seqs):
            raise RuntimeError("injected fault in one row")
        return orig(seqs, *a, **kw)

    sched.native.decode_step = faulty
    for p in bad:  # one faulty neighbour at a time, each failed before the next arrives
        reqs.append(sched.add(p, short, "native"))
        for _ in range(50):
            _, f = _run(sched, reqs, streamed, steps=1)
            failed.update(f)
            if reqs[-1].id in failed:
                break
        assert reqs[-1].id in failed and not reqs[0].seq.done
    _, f = _run(sched, reqs, streamed)
    failed.update(f)
    assert set(failed) == {r.id for r in reqs[1:]}
    assert sched.stats.batch_faults == len(bad) and sched.runner.allocator.num_free == free0
    _check_others_exact(target, drafter, reqs, prompts, [long] + [short] * len(bad), ["native"] * len(reqs),
                        streamed, {r.id for r in reqs[1:]})


def test_a_transient_batch_fault_fails_nobody_and_changes_nothing(pair):
    target, drafter = pair
    prompts = _prompts(4, 5)
    methods = ["dflash", "native", "dflash", "native"]
    # sampled rows too: rolled back to what they streamed, they draw the same tokens again (draws keyed by
    # token index, engine/sampling.py), so they also equal their solo runs
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **kw) for m, kw in
              zip((36, 30, 44, 26), ({}, {}, dict(temperature=0.9, seed=5), dict(temperature=1.1, top_k=9, seed=6)))]
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    sched.overlap = False
    free0 = sched.runner.allocator.num_free
    reqs = [sched.add(p, sp, m) for p, sp, m in zip(prompts, params, methods)]
    orig, calls = sched.spec.spec_step, []

    def once(seqs, *a, **kw):  # the third DFlash step of the batch raises once, after committing its tokens
        calls.append(len(seqs))
        out = orig(seqs, *a, **kw)
        if len(calls) == 3:
            raise RuntimeError("transient")
        return out

    sched.spec.spec_step = once
    streamed, failed = _run(sched, reqs)
    assert failed == {} and sched.stats.batch_faults == 1
    assert sched.runner.allocator.num_free == free0
    _check_others_exact(target, drafter, reqs, prompts, params, methods, streamed, set())


def test_a_step_rolled_back_by_a_fault_counts_once_in_the_position_stats(pair):
    """A step that committed its tokens and then raised is rolled back and run again: its tokens and acceptance
    length are kept once, and so must its per-position counts (position_accepts / position_drafted), or the
    redone step is counted twice and position_acceptance is skewed toward the rolled-back steps."""
    target, drafter = pair
    prompt, params = _prompts(1, 41)[0], SamplingParams(max_tokens=40, ignore_eos=True)
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    sched.overlap = False
    req = sched.add(prompt, params, "dflash")
    orig, calls = sched.spec.spec_step, []

    def after_commit(seqs, *a, **kw):  # the third step raises once, after committing its tokens
        calls.append(1)
        orig(seqs, *a, **kw)
        if len(calls) == 3:
            raise RuntimeError("transient")

    sched.spec.spec_step = after_commit
    streamed, failed = _run(sched, [req])
    assert failed == {} and sched.stats.batch_faults == 1
    solo = _solo_seq(target, drafter, prompt, params, "dflash")
    assert streamed[req.id] == req.seq.output == solo.output
    assert req.seq.stats.acceptance_lengths == solo.stats.acceptance_lengths
    assert _positions(req.seq) == _positions(solo)
    assert req.seq.stats.as_dict()["position_acceptance"] == solo.stats.as_dict()["position_acceptance"]


class _RaisingStore(MemoryStore):
    """A real memory store whose reads of one key raise an error the bridge guard does not expect."""

    def __init__(self, bad_key: str) -> None:
        super().__init__(1 << 26)
        self.bad_key = bad_key

    def lookup(self, keys: list[str]) -> int:
        if self.bad_key in keys:
            raise RuntimeError("injected store fault")
        return super().lookup(keys)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_admission_fault_fails_that_request_only_while_a_batch_runs(pair, overlap):
    target, drafter = pair
    prompts = _prompts(4, 7, lo=40, hi=90)
    runner = _runner(target, drafter)
    fp = "f" * 64
    bad = chunk_keys(prompts[3][:-1], 16, fp)[0]
    cache = PrefixCache(_RaisingStore(bad), fp, chunk_tokens=16)
    sched = Scheduler(runner, drafter, prefix_cache=cache, policy="preempt")
    sched.overlap = overlap
    free0 = runner.allocator.num_free
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 34, 45, 30)]
    reqs = [sched.add(p, sp, "dflash") for p, sp in zip(prompts[:3], params[:3])]
    early, _ = _run(sched, reqs, steps=2)
    reqs.append(sched.add(prompts[3], params[3], "dflash"))  # arrives while the others run
    streamed, failed = _run(sched, reqs, early)
    assert set(failed) == {reqs[3].id} and "injected store fault" in str(failed[reqs[3].id])
    assert runner.allocator.num_free == free0
    _check_others_exact(target, drafter, reqs, prompts, params, ["dflash"] * 4, streamed, {reqs[3].id})


def test_engine_loop_reports_the_failure_and_keeps_serving(pair):
    target, drafter = pair
    prompts = _prompts(3, 9)
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    sched.overlap = False
    _rows_raise_for(sched.native, "decode_step", prompts[0])
    free0 = sched.runner.allocator.num_free
    loop = EngineLoop(sched)
    try:
        sp = SamplingParams(max_tokens=30, ignore_eos=True)
        hs = [loop.submit(p, sp, "native") for p in prompts]
        ends = {}
        deadline = time.monotonic() + 120
        while len(ends) < 3 and time.monotonic() < deadline:
            for i, h in enumerate(hs):
                if i not in ends:
                    ev = h.get(0.05)
                    if ev is not None and ev.kind in ("done", "error", "cancelled"):
                        ends[i] = ev
        assert ends[0].kind == "error" and isinstance(ends[0].error, RequestFailed)
        assert ends[1].kind == ends[2].kind == "done"
        assert loop.alive
        h = loop.submit(prompts[1], sp, "native")  # still serving
        toks = []
        while True:
            ev = h.get(30)
            assert ev is not None
            if ev.kind == "tokens":
                toks += ev.tokens
            else:
                break
        assert ev.kind == "done" and toks == _solo(target, drafter, prompts[1], sp, "native")[0]
        t0 = time.monotonic()
        while sched.runner.allocator.num_free != free0 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert sched.runner.allocator.num_free == free0
    finally:
        loop.stop()


def test_an_uncontained_step_error_fails_the_batch_not_the_loop(pair):
    """Should a step still raise past the scheduler's own recovery (here: the admission bookkeeping),
    the loop fails what is in flight, frees every block and keeps serving."""
    target, drafter = pair
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    sched.overlap = False  # _make_room runs on every stepwise step
    free0 = sched.runner.allocator.num_free
    orig, n = sched._make_room, []

    def broken() -> None:
        n.append(1)
        if len(n) == 2:
            raise RuntimeError("scheduler bug")
        orig()

    sched._make_room = broken
    loop = EngineLoop(sched)
    try:
        sp = SamplingParams(max_tokens=20, ignore_eos=True)
        h = loop.submit(_prompts(1, 2)[0], sp, "dflash")
        kinds = []
        while not kinds or kinds[-1] not in ("done", "error"):
            ev = h.get(30)
            assert ev is not None
            kinds.append(ev.kind)
        assert kinds[-1] == "error" and loop.alive
        assert sched.runner.allocator.num_free == free0 and sched.idle
        h2 = loop.submit(_prompts(1, 4)[0], sp, "native")
        while (ev := h2.get(30)) is not None and ev.kind == "tokens":
            pass
        assert ev is not None and ev.kind == "done"
    finally:
        loop.stop()


def test_prefill_worker_frees_its_blocks_when_a_prefill_fails(pair):
    target, drafter = pair
    runner = _runner(target, drafter)
    fp = "a" * 64
    prompt = _prompts(1, 11, lo=60, hi=61)[0]
    cache = PrefixCache(_RaisingStore(chunk_keys(prompt[:-1], 16, fp)[0]), fp, chunk_tokens=16)
    worker = PrefillWorker(runner, drafter, cache)
    free0 = runner.allocator.num_free
    for _ in range(5):
        with pytest.raises(RuntimeError, match="injected store fault"):
            worker.prefill(prompt, SamplingParams(max_tokens=8))
    assert runner.allocator.num_free == free0
    ok = worker.prefill(_prompts(1, 12)[0], SamplingParams(max_tokens=8))  # the worker still works
    assert ok.first_token >= 0 and runner.allocator.num_free == free0


def test_a_fault_inside_the_device_loop_session_is_recovered_exactly(pair):
    """The stable greedy batch steps in the device loop; its read raising once ends the session, and
    every row continues from the tokens it had streamed, as in an undisturbed run."""
    target, drafter = pair
    prompts = _prompts(3, 13)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 35, 45)]
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    free0 = sched.runner.allocator.num_free
    loop = sched.spec.loop()
    orig, calls = loop.read, []

    def read_once(sess) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device loop fault")
        orig(sess)

    loop.read = read_once
    reqs = [sched.add(p, sp, "dflash") for p, sp in zip(prompts, params)]
    streamed, failed = _run(sched, reqs)
    assert len(calls) >= 2 and sched.overlapped_steps > 0, "the batch never stepped in the device loop"
    assert failed == {} and sched.stats.batch_faults == 1
    assert sched.runner.allocator.num_free == free0
    _check_others_exact(target, drafter, reqs, prompts, params, ["dflash"] * 3, streamed, set())


def _ride_a_session(sched: Scheduler, session: str) -> None:
    """Keep a finished row in its device-loop session until the session ends: drain (the offline batch: until
    its last row ends) or a hold (serving: here until the other row ends too)."""
    if session == "drain":
        sched.drain = True
    else:
        sched.hold_fraction, sched.hold_steps = 1.0, 1000


@pytest.mark.parametrize("session,bad_reads,earlier_faults", [
    ("drain", 1, 0), ("hold", 1, MAX_BATCH_FAULTS - 1), ("drain", 2, MAX_BATCH_FAULTS - 1), ("hold", 2, 0)])
def test_a_step_fault_finishes_a_row_streamed_to_its_end_and_recomputes_only_the_others(
        pair, monkeypatch, session, bad_reads, earlier_faults):
    """A row streamed to its end rides its session (drain, a hold); a step fault then finishes it as the session's
    clean end would: not failed (even at its last allowed batch fault), not recomputed. Only the unfinished row is
    rolled back, recomputed and finished exactly. bad_reads 2: the session's end raises too, and it is dropped."""
    target, drafter = pair
    prompts = _prompts(2, 19)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (8, 40)]
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    _ride_a_session(sched, session)
    free0 = sched.runner.allocator.num_free
    reqs = [sched.add(p, sp, "dflash") for p, sp in zip(prompts, params)]
    done, live = reqs
    streamed: dict[int, list[int]] = {r.id: [] for r in reqs}
    while not done.seq.done:
        _, failed = _run(sched, reqs, streamed, steps=1)
        assert failed == {} and sched.steps < 100
    assert done in sched.running and sched._session is not None and not live.seq.done, "no finished row rode along"
    assert streamed[done.id] == done.seq.output
    done.batch_faults = earlier_faults  # faults it was part of (and survived) before it finished
    recomputed: list[list[int]] = []
    orig_recompute = scheduler_mod.recompute

    def spy(gen, seqs, *a, **kw):
        recomputed.extend(s.prompt for s in seqs)
        return orig_recompute(gen, seqs, *a, **kw)

    monkeypatch.setattr(scheduler_mod, "recompute", spy)
    loop, left = sched.spec.loop(), [bad_reads]
    orig_read = loop.read

    def read(sess) -> None:
        if left[0]:
            left[0] -= 1
            raise RuntimeError("device loop fault")
        orig_read(sess)

    loop.read = read
    res = sched.step()
    assert left[0] == 0 and sched.stats.batch_faults == 1
    assert res.failed == [] and res.finished == [done] and done.id not in res.new_tokens
    for rid, toks in res.new_tokens.items():
        streamed[rid].extend(toks)
    streamed, failed = _run(sched, reqs, streamed)
    assert failed == {} and sched.stats.failed_requests == 0
    assert recomputed == [live.seq.prompt], "only the unfinished row is recomputed"
    assert sched.runner.allocator.num_free == free0 and not sched._suspects
    _check_others_exact(target, drafter, reqs, prompts, params, ["dflash"] * 2, streamed, set())


def _two_in_one_session(loop: EngineLoop, prompts, params) -> tuple[list, list[list[int]], dict[int, object]]:
    """Two DFlash requests taken in one pass (admitted together, into one session), read to their ends: (handles,
    each one's streamed tokens, each one's final event)."""
    with loop._cv:
        hs = [loop.submit_nowait(p, sp, "dflash")[0] for p, sp in zip(prompts, params)]
    toks: list[list[int]] = [[], []]
    ends: dict[int, object] = {}
    deadline = time.monotonic() + 120
    while len(ends) < 2 and time.monotonic() < deadline:
        for i, h in enumerate(hs):
            ev = None if i in ends else h.get(0.05)
            if ev is not None and ev.kind == "tokens":
                toks[i] += ev.tokens
            elif ev is not None:
                ends[i] = ev
    return hs, toks, ends


def test_an_uncontained_error_ends_a_request_streamed_to_its_end_done_and_fails_the_rest(pair):
    """abort_all (the engine loop's last resort) ends a request already streamed to its end, riding a held
    session, "done" with all its tokens, as the session's end would have; only the unfinished one gets an error.
    Every block is back and the loop serves on."""
    target, drafter = pair
    prompts = _prompts(2, 23)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (8, 40)]
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    _ride_a_session(sched, "hold")
    free0 = sched.runner.allocator.num_free
    orig, hit = sched._hold_for_prefill, []

    def broken() -> None:  # outside the step's own recovery: uncontained
        if not hit and sched._session is not None and any(r.seq.done for r in sched.running):
            hit.append(sorted((r.id, r.seq.done) for r in sched.running))
            raise RuntimeError("scheduler bug")
        orig()

    sched._hold_for_prefill = broken
    loop = EngineLoop(sched)
    try:
        hs, toks, ends = _two_in_one_session(loop, prompts, params)
        assert hit == [[(hs[0].request.id, True), (hs[1].request.id, False)]], hit
        out, acc = _solo(target, drafter, prompts[0], params[0], "dflash")
        assert ends[0].kind == "done" and ends[0].finish_reason == "length"
        assert toks[0] == out and list(ends[0].stats["acceptance_lengths"]) == acc
        assert ends[1].kind == "error" and isinstance(ends[1].error, RequestFailed)
        assert "scheduler bug" in str(ends[1].error) and loop.alive
        t0 = time.monotonic()
        while not (sched.idle and sched.runner.allocator.num_free == free0) and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert sched.idle and sched.runner.allocator.num_free == free0
    finally:
        loop.stop()


def test_a_stop_ends_a_request_streamed_to_its_end_done_and_the_rest_with_an_error(pair):
    """EngineLoop.stop() while a request streamed to its end rides a held session: it ends "done" with all its
    tokens and its stats (the session's end would have ended it so), the unfinished one gets EngineStopped,
    and every block is back. Before, the stop cancelled both, and the whole one ended with an error."""
    from flashpd.decode_node.engine_loop import EngineStopped

    target, drafter = pair
    prompts = _prompts(2, 31)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (8, 60)]
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    _ride_a_session(sched, "hold")
    free0 = sched.runner.allocator.num_free
    seen: list[list[tuple[int, bool]]] = []

    def stop_when_one_rides() -> None:  # the loop thread, after a step: the next pass shuts down
        if not seen and sched._session is not None and any(r.seq.done for r in sched.running):
            seen.append(sorted((r.id, r.seq.done) for r in sched.running))
            loop.stop()

    loop = EngineLoop(sched, after_step=stop_when_one_rides)
    try:
        hs, toks, ends = _two_in_one_session(loop, prompts, params)
        assert seen == [[(hs[0].request.id, True), (hs[1].request.id, False)]], seen
        out, acc = _solo(target, drafter, prompts[0], params[0], "dflash")
        assert ends[0].kind == "done" and ends[0].finish_reason == "length", ends[0]
        assert toks[0] == out and list(ends[0].stats["acceptance_lengths"]) == acc
        assert ends[1].kind == "error" and isinstance(ends[1].error, EngineStopped), ends[1]
        assert not loop.alive and sched.idle and sched.runner.allocator.num_free == free0
    finally:
        loop.stop()


def test_tokens_of_a_step_that_raised_are_not_counted_as_streamed(pair, monkeypatch):
    """Two rows end in one step and finishing the second raises: the step's result (the first row's last tokens)
    never reaches the caller, so abort_all must fail both, not end the first "done" without its last tokens."""
    target, drafter = pair
    prompts = _prompts(2, 29)
    params = [SamplingParams(max_tokens=6, ignore_eos=True)] * 2
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    free0 = sched.runner.allocator.num_free
    first, second = [sched.add(p, sp, "native") for p, sp in zip(prompts, params)]
    orig_finish = sched._finish

    def finish(r) -> None:
        orig_finish(r)
        if r is second:
            raise RuntimeError("finish failed")

    monkeypatch.setattr(sched, "_finish", finish)
    streamed: dict[int, list[int]] = {first.id: [], second.id: []}
    with pytest.raises(RuntimeError, match="finish failed"):
        for _ in range(100):
            res = sched.step()
            for rid, toks in res.new_tokens.items():
                streamed[rid].extend(toks)
    assert first.seq.done and len(streamed[first.id]) < len(first.seq.output)
    res = sched.abort_all(RuntimeError("finish failed"))
    assert res.finished == [] and {r.id for r, _ in res.failed} == {first.id, second.id}
    assert sched.idle and sched.runner.allocator.num_free == free0


def test_through_the_grpc_api_the_faulty_request_gets_internal_and_the_batch_finishes_exactly(pair):
    """A real generation server on 127.0.0.1 over a scheduler whose step raises for one request's row:
    that stream ends INTERNAL with its cause, the concurrent streams finish with their solo tokens and
    acceptance lengths, and Health shows every KV block free again."""
    import threading

    import grpc

    from flashpd.cluster.generation_client import GenerationClient
    from flashpd.cluster.generation_server import serve_generation
    from tests._cluster_helpers import stream_chunks

    target, drafter = pair
    prompts = _prompts(5, 17)
    methods = ["dflash", "native", "dflash", "dflash", "native"]
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    sched.overlap = False
    _rows_raise_for(sched.spec, "spec_step", prompts[2])
    loop = EngineLoop(sched)
    server, port = serve_generation(loop)
    client = GenerationClient(f"127.0.0.1:{port}")
    try:
        free0 = client.health()["kv_blocks_free"]
        results: dict[int, object] = {}

        def one(i: int) -> None:
            try:
                results[i] = stream_chunks(client, prompts[i], max_tokens=40, method=methods[i], ignore_eos=True)
            except Exception as e:  # noqa: BLE001  the faulty one
                results[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        err = results[2]
        assert getattr(err, "code", None) == grpc.StatusCode.INTERNAL, err
        assert "injected fault in one row" in str(err)
        sp = SamplingParams(max_tokens=40, ignore_eos=True)
        for i in (0, 1, 3, 4):
            toks, last = results[i]
            out, acc = _solo(target, drafter, prompts[i], sp, methods[i])
            assert toks == out and list(last.stats["acceptance_lengths"]) == acc, f"request {i} ({methods[i]})"
        t0 = time.monotonic()
        while client.health()["kv_blocks_free"] != free0 and time.monotonic() - t0 < 10.0:
            time.sleep(0.01)
        h = client.health()
        assert h["kv_blocks_free"] == free0 and h["running"] == 0 and h["serving"]
    finally:
        client.close()
        server.stop(0)
        loop.stop()


def test_a_transient_fault_under_kv_pressure_fails_nobody(pair):
    """After a batch fault each suspect takes its next step alone, once: a row that passed must not step again
    with the rest in the same step (preempt policy reserves only one step's blocks per row, so a second step ran
    out of blocks, which counted as more batch faults until both innocent rows were failed)."""
    target, drafter = pair
    prompts = [list(range(10, 24)), list(range(40, 54))]  # 14 tokens: the 18th decode step ends a 2-block context
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 2
    sched = Scheduler(_runner(target, drafter, blocks=5), drafter, policy="preempt")  # 4 blocks: each row's worst case
    sched.overlap = False
    free0 = sched.runner.allocator.num_free
    orig, calls = sched.native.decode_step, []

    def once(seqs, *a, **kw):  # the 18th step raises before its work: both rows then hold 2 full blocks, none free
        calls.append([s.prompt[0] for s in seqs])
        if len(calls) == 18:
            raise RuntimeError("transient")
        return orig(seqs, *a, **kw)

    sched.native.decode_step = once
    reqs = [sched.add(p, sp, "native") for p, sp in zip(prompts, params)]
    streamed, failed = _run(sched, reqs)
    assert failed == {} and sched.stats.batch_faults == 1
    assert sched.runner.allocator.num_free == free0 and not sched._suspects
    _check_others_exact(target, drafter, reqs, prompts, params, ["native"] * 2, streamed, set())


@pytest.mark.parametrize("trigger", ["arrival", "finish"])
def test_a_fault_read_when_a_session_ends_between_steps_is_recovered_exactly(pair, trigger):
    """A device-loop session also ends outside the batch step: at an arrival (before admitting it) and at a finished
    row (after the step). Its in-flight step raising there is a batch step's fault like any other: recovered (every
    row back to what it streamed, recomputed), not an error out of step() that fails every request in flight."""
    target, drafter = pair
    prompts = _prompts(3, 29)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 12 if trigger == "finish" else 45, 30)]
    n = 3 if trigger == "arrival" else 2
    sched = Scheduler(_runner(target, drafter), drafter, policy="preempt")
    free0 = sched.runner.allocator.num_free
    reqs = [sched.add(p, sp, "dflash") for p, sp in zip(prompts[:2], params[:2])]
    streamed, failed = _run(sched, reqs, steps=3)
    assert sched._session is not None and failed == {} and not any(r.seq.done for r in reqs), "no session"
    loop, armed = sched.spec.loop(), [True]
    orig = loop.read

    def read(sess) -> None:  # arrival: the read of the session's end; finish: the first read after a row's end
        if armed[0] and (sched.waiting if trigger == "arrival" else any(s.done for s in sess.seqs)):
            armed[0] = False
            raise RuntimeError("device loop fault")
        orig(sess)

    loop.read = read
    if trigger == "arrival":
        reqs.append(sched.add(prompts[2], params[2], "dflash"))
    streamed, failed = _run(sched, reqs, streamed)
    assert not armed[0] and failed == {} and sched.stats.batch_faults == 1
    assert sched.runner.allocator.num_free == free0 and not sched._suspects
    _check_others_exact(target, drafter, reqs[:n], prompts[:n], params[:n], ["dflash"] * n, streamed, set())


def test_an_engine_loop_stopped_while_its_session_cannot_end_frees_every_block(pair):
    """Stopping the loop cancels what is in flight. Should the device session's end raise then, it is dropped:
    every request's blocks and reservation still come back (a cancel that raised left its request holding them)."""
    target, drafter = pair
    sched = Scheduler(_runner(target, drafter), drafter)
    free0 = sched.runner.allocator.num_free
    loop = EngineLoop(sched, idle_wait_s=0.01)
    dev = sched.spec.loop()
    orig_end = dev.end

    def end(sess) -> None:
        if not loop.alive:  # stopping: the session's end raises
            raise RuntimeError("device loop fault at shutdown")
        orig_end(sess)

    dev.end = end
    try:
        hs = [loop.submit(p, SamplingParams(max_tokens=200, ignore_eos=True), "dflash") for p in _prompts(2, 31)]
        deadline = time.monotonic() + 60
        while sched._session is None or any(h.events.empty() for h in hs):
            assert time.monotonic() < deadline, "the batch never stepped in a device-loop session"
            time.sleep(0.005)
    finally:
        loop.stop()
    assert sched.runner.allocator.num_free == free0 and sched._reserved == 0 and sched.idle
    assert [h.events.queue[-1].kind for h in hs] == ["error", "error"]


@pytest.mark.parametrize("session", ["stream", "hold"])
def test_a_cancel_whose_session_end_faults_frees_it_and_recovers_the_others_exactly(pair, session):
    """A cancel ends the device-loop session first, which reads the step in flight. That read raising is a batch
    fault like any other: the cancelled request still frees its blocks and reservation (a cancel that raised kept
    them, and the engine loop then failed every other request), the others are recovered exactly, and a row streamed
    to its end (riding a hold) is finished by the next step as the session's end would have."""
    target, drafter = pair
    prompts = _prompts(3, 37)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (8 if session == "hold" else 40, 45, 30)]
    sched = Scheduler(_runner(target, drafter), drafter)  # policy reserve: a leaked reservation shows too
    if session == "hold":
        _ride_a_session(sched, "hold")
    free0 = sched.runner.allocator.num_free
    reqs = [sched.add(p, sp, "dflash") for p, sp in zip(prompts, params)]
    done, gone = reqs[0], reqs[2]
    streamed: dict[int, list[int]] = {r.id: [] for r in reqs}
    while sched.steps < 3 or (session == "hold" and not done.seq.done):
        _, failed = _run(sched, reqs, streamed, steps=1)
        assert failed == {} and sched.steps < 100
    assert sched._session is not None and sched._session.queued and not gone.seq.done, "no step in flight"
    loop, armed = sched.spec.loop(), [True]
    orig = loop.read

    def read(sess) -> None:
        if armed[0]:
            armed[0] = False
            raise RuntimeError("device loop fault at a cancel")
        orig(sess)

    loop.read = read
    sched.cancel(gone)
    assert not armed[0] and sched.stats.batch_faults == 1
    assert gone.seq.finish_reason == "cancelled" and gone.seq.output == streamed[gone.id]
    res = sched.step()
    assert res.failed == [] and (done in res.finished) == (session == "hold")
    for rid, toks in res.new_tokens.items():
        streamed[rid].extend(toks)
    streamed, failed = _run(sched, reqs, streamed)
    assert failed == {} and sched.idle and not sched._suspects
    assert sched.runner.allocator.num_free == free0 and sched._reserved == 0
    _check_others_exact(target, drafter, reqs, prompts, params, ["dflash"] * 3, streamed, {gone.id})


class _NoThreads(ThreadPoolExecutor):
    """A pool that cannot start its thread (as when the OS refuses one): submit raises."""

    def submit(self, *args, **kwargs):
        raise RuntimeError("can't start new thread")


class _Importer:
    """A dist-path importer whose fetches run off the engine loop; it records the leases given back."""

    can_fetch = True

    def __init__(self) -> None:
        self.released: list[Handoff] = []

    def fetch(self, lease: Handoff) -> None:  # what a load thread would run
        raise AssertionError("no thread started")

    def release(self, lease: Handoff) -> None:
        self.released.append(lease)


@pytest.mark.parametrize("load", ["prefix", "lease"])
def test_an_add_whose_load_cannot_start_leaves_nothing_queued_or_held(pair, load):
    """add() starts the request's load (a prefix fetch, a lease's fetch) after queueing it. Should that raise, the
    caller gets the error and no handle: the request must not stay queued (it ran later, unseen), and its lease is
    given back. The scheduler serves on."""
    target, drafter = pair
    prompt, other = _prompts(2, 41)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runner = _runner(target, drafter)
    free0 = runner.allocator.num_free
    lease = None
    if load == "prefix":
        sched = Scheduler(runner, drafter, prefix_cache=PrefixCache(MemoryStore(1 << 24), "f" * 64, 32))
        sched._loader = _NoThreads()
    else:
        sched = DecodeScheduler(runner, drafter)
        sched.handoff, sched._import_pool = _Importer(), _NoThreads()
        lease = Handoff("x", "", b"", 1, (0,), (0,), len(prompt), prompt_digest(prompt))
    with pytest.raises(RuntimeError, match="can't start new thread"):
        sched.add(prompt, params, "native", first_token=5 if lease else None, handoff=lease)
    assert sched.idle and not sched.waiting and sched._reserved == 0
    if lease is not None:
        assert sched.handoff.released == [lease]
    sched._loader = sched._import_pool = None  # threads start again
    req = sched.add(other, params, "native")
    streamed, failed = _run(sched, [req])
    assert failed == {} and sched.admitted == 1, "only the request that was added ran"
    assert runner.allocator.num_free == free0
    _check_others_exact(target, drafter, [req], [other], [params], ["native"], streamed, set())

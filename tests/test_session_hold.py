"""Holding a serving session past its finished rows and arrivals (Scheduler.hold_fraction): a closed loop keeps
every request's tokens, acceptance and streamed order, restarts fewer sessions, ends a finished request at most
hold_steps steps late, and leaves every block free. Stop tokens and a cancel inside a held session too."""
from __future__ import annotations

from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import Scheduler

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)
from tests.test_scheduler import _prompts, pair  # noqa: F401  (module fixture)


def _closed_loop(pair, hold: float, method: str, conc: int = 8, n: int = 20, steps: int = 3, stop_ids=(),
                 cancel_at: int | None = None, blocks: int = 1024):
    """conc requests in flight; each finished one is replaced at once (the sweep's clients), n in all. Returns
    per request (output, acceptance, streamed, finish reason), the steps between a row's last token and its end,
    and the scheduler."""
    target, drafter = pair
    runner = ModelRunner(target, blocks, 16, taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(cuda_graphs=False, compile=False))
    sched = Scheduler(runner, drafter, stop_ids, max_running=conc, policy="preempt")
    sched.hold_fraction, sched.hold_steps = hold, steps
    prompts = _prompts(n, 11)
    lens = [12, 30, 21, 17, 40, 9, 26, 33]
    reqs, streamed, last_token_step, late, sent, step = [], {}, {}, [], 0, 0

    def send() -> None:
        nonlocal sent
        reqs.append(sched.add(prompts[sent], SamplingParams(max_tokens=lens[sent % len(lens)], ignore_eos=not stop_ids),
                              method))
        sent += 1

    for _ in range(conc):
        send()
    while not sched.idle or sent < n:
        res = sched.step()
        step += 1
        for rid, toks in res.new_tokens.items():
            streamed.setdefault(rid, []).extend(toks)
        for r in reqs:
            if r.seq.done and r.id not in last_token_step:
                last_token_step[r.id] = step
        for r in res.finished:
            late.append(step - last_token_step[r.id])
            if sent < n:
                send()
        if cancel_at is not None and step == cancel_at:
            live = [r for r in reqs if not r.seq.done]
            sched.cancel(live[0])
        assert step < 3000
    assert runner.allocator.num_free == blocks - 1, "blocks leaked"
    # a cancelled request ends with what it streamed: how far it got by the cancel's step is the path's, so it is
    # compared with its own stream only
    for r in reqs:
        if r.seq.finish_reason == "cancelled":
            assert r.seq.output == streamed.get(r.id, [])
    out = [(r.seq.output, r.seq.stats.acceptance_lengths, streamed.get(r.id), r.seq.finish_reason)
           if r.seq.finish_reason != "cancelled" else (None, None, None, "cancelled") for r in reqs]
    return out, late, sched


def test_a_held_closed_loop_keeps_every_token_and_restarts_less(pair):  # noqa: F811
    for method in ("dflash", "native"):
        want, late0, plain = _closed_loop(pair, 0.0, method)
        got, late, held = _closed_loop(pair, 0.5, method)
        assert got == want, method
        assert all(o == s for o, _, s, _ in got)  # streamed in order, nothing lost
        assert max(late0) == 0 and max(late) <= 3  # a finished request waits at most hold_steps steps
        assert held.overlapped_steps > 0
        if method == "dflash":  # rows of different lengths finish apart: the hold batches their restarts
            assert held.sessions_ended < plain.sessions_ended, (held.sessions_ended, plain.sessions_ended)
            assert max(late) > 0


def test_a_hold_with_stop_tokens_and_a_cancel_stays_exact(pair):  # noqa: F811
    target, drafter = pair
    want, _, _ = _closed_loop(pair, 0.0, "dflash", stop_ids=(3, 7), cancel_at=9)
    got, late, held = _closed_loop(pair, 1.0, "dflash", stop_ids=(3, 7), cancel_at=9)
    assert got == want and max(late) <= 3
    assert any(reason == "cancelled" for *_, reason in got)



def test_a_hold_under_kv_pressure_preempts_and_stays_exact(pair):  # noqa: F811
    """A cache too small for every request in flight: the preempt policy preempts and recomputes rows, with the
    hold on as without it: the same tokens and acceptance, no block left used."""
    want, _, plain = _closed_loop(pair, 0.0, "dflash", blocks=40)
    got, late, held = _closed_loop(pair, 0.5, "dflash", blocks=40)
    assert got == want and max(late) <= 3
    assert plain.stats.preemptions > 0 and held.stats.preemptions > 0


def test_the_serve_config_reaches_a_decode_workers_scheduler_after_its_warmup(dflash_pair, monkeypatch):  # noqa: F811
    """session_hold_fraction / _steps reach the scheduler that build_decode makes (every mode builds it so); the
    warm-up runs without a hold (it was measured that way), and a held worker still serves exactly."""
    import sys

    from flashpd.cluster.config import ServeConfig
    from flashpd.cluster.metrics import Metrics
    from flashpd.cluster.worker_main import build_decode, load_model
    from flashpd.engine import warmup
    from tests.test_decode_worker import _drain

    seen = []  # the hold each warm-up met (the warm-up itself is tests/test_warmup.py's: not run again here)
    monkeypatch.setattr(warmup, "warm_scheduler", lambda sched, *a, **k: seen.append(sched.hold_fraction) or
                        {"requests": 0, "methods": [], "lengths": [], "seconds": 0.0})
    switch = sys.getswitchinterval()
    cfg = ServeConfig(target=str(dflash_pair.target_dir), draft=str(dflash_pair.draft_dir), device="cpu",
                      dtype="float32", kv_cache_tokens=2048, max_running=4, warmup=True, session_hold_fraction=0.5,
                      session_hold_steps=2)
    try:
        worker = build_decode(cfg, load_model(cfg), None, Metrics("test"))
    finally:
        sys.setswitchinterval(switch)
    try:
        assert seen == [0.0] and (worker.scheduler.hold_fraction, worker.scheduler.hold_steps) == (0.5, 2)
        p = SamplingParams(max_tokens=12, ignore_eos=True)
        handles = [worker.submit(q, p, "dflash") for q in _prompts(3, 4)]
        outs = [_drain(h)[0] for h in handles]
        plain = _native_alone(worker.scheduler.runner.model, _prompts(3, 4), p)
        assert outs == plain
    finally:
        worker.stop(10)


def _native_alone(target, prompts, params):
    """Native greedy tokens of each prompt alone (DFlash's must equal them in float32)."""
    from flashpd.engine.generate import NativeGenerator
    from flashpd.engine.scheduler import generate
    runner = ModelRunner(target, 256, 16, config=RunnerConfig(cuda_graphs=False, compile=False))
    return [s.output for s in generate(NativeGenerator(runner), prompts, [params] * len(prompts))]

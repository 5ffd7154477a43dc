"""The device loop (engine/device_loop.py): whole greedy requests whose step bookkeeping runs on the
device, read by the host one step late. It must give exactly what the stepwise loop gives (tokens,
acceptance lengths, per-position acceptance, finish reasons), with stop tokens and max_tokens landing
anywhere in a block, rows of one batch ending at different steps, and the graph path's padding (batch
and block tables bucketed) run eagerly here. The lag is real on the CPU too: a step is launched
before the previous one is read, so steps past a row's end run and must change nothing."""
from __future__ import annotations

import pytest
import torch

from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator, sample_rows
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator, Seam
from flashpd.engine.scheduler import generate

from tests._dflash_helpers import dflash_pair, reference_generate  # noqa: F401  (session fixture)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 126, (int(k),), generator=g).tolist() for k in torch.randint(1, 120, (n,), generator=g)]


def _run(pair, prompts, params, on_device: bool, graphs: bool, spec: bool, stop_ids=(), step_width: int = 1):
    target = load_target(pair.target_dir)
    drafter = load_drafter(pair.draft_dir, target)
    runner = ModelRunner(target, 512, 16, taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(cuda_graphs=graphs, compile=False))
    gen = DFlashGenerator(runner, drafter, stop_ids, 16) if spec else \
        NativeGenerator(runner, stop_ids, step_width=step_width)
    gen.device_loop = on_device
    seqs = generate(gen, prompts, params)
    sessions = gen._loop.sessions if gen._loop is not None else 0
    assert sessions == (1 if on_device else 0), "the loop asked for was not the one that ran"
    assert runner.allocator.num_free == runner.allocator.num_blocks - 1, "blocks leaked"
    return [(s.output, s.finish_reason, s.stats.acceptance_lengths, s.stats.position_accepts,
             s.stats.position_drafted) for s in seqs]


@pytest.mark.parametrize("spec", [True, False], ids=["dflash", "native"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_device_loop_equals_stepwise_loop(dflash_pair, spec, graphs):  # noqa: F811
    prompts = _prompts(5, 21)  # batch 5: padded to 8 on the graph path
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 2, 17, 40, 33)]
    got = _run(dflash_pair, prompts, params, True, graphs, spec)
    want = _run(dflash_pair, prompts, params, False, graphs, spec)
    assert got == want
    assert [len(g[0]) for g in got] == [1, 2, 17, 40, 33]
    if spec:
        assert max(a for g in got for a in g[2]) > 1, "nothing accepted: the comparison would be weak"


def test_native_at_the_verify_shapes_gives_the_same_tokens(dflash_pair):  # noqa: F811
    """step_width 16: each token rides in a 16-column forward (padding columns write scratch); the tokens,
    finish reasons and freed blocks are those of the one-token step, with a row finishing mid-batch."""
    prompts = _prompts(3, 8)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 12, 7)]
    got = _run(dflash_pair, prompts, params, True, True, False, step_width=16)
    assert got == _run(dflash_pair, prompts, params, True, True, False)
    runner = ModelRunner(load_target(dflash_pair.target_dir), 512, 16,
                         config=RunnerConfig(cuda_graphs=True, compile=False))
    widths, forward = [], runner.model_step
    runner.model_step = lambda ids, *a, **k: (widths.append(ids.shape[1]), forward(ids, *a, **k))[1]
    generate(NativeGenerator(runner, step_width=16), prompts[:1], params[1:2])
    assert widths.count(16) == 11, "the device loop's steps did not run at the verify's width"
    with pytest.raises(ValueError, match="step_width"):
        NativeGenerator(None, step_width=0)


@pytest.mark.parametrize("spec", [True, False], ids=["dflash", "native"])
def test_stop_tokens_end_rows_at_different_steps(dflash_pair, spec):  # noqa: F811
    """A stop token inside an accepted block ends its row there; the device keeps stepping that row (its
    state is not told) while the others run, and nothing of those steps reaches any output."""
    prompts = _prompts(4, 5)
    base = _run(dflash_pair, prompts, [SamplingParams(max_tokens=48, ignore_eos=True)] * 4, False, True, spec)
    # stop ids: tokens that first appear at different depths of different rows
    stops = {base[0][0][5], base[2][0][20]}
    params = [SamplingParams(max_tokens=48) for _ in prompts]
    got = _run(dflash_pair, prompts, params, True, True, spec, stop_ids=stops)
    want = _run(dflash_pair, prompts, params, False, True, spec, stop_ids=stops)
    assert got == want
    assert {g[1] for g in got} == {"stop", "length"} or all(g[1] == "stop" for g in got)
    assert any(len(g[0]) < 48 for g in got)


def test_device_loop_matches_reference_dflash(dflash_pair):  # noqa: F811
    """Against the reference package's own loop: same tokens and acceptance lengths per step."""
    prompts = _prompts(3, 9)
    maxes = [24, 37, 50]
    got = _run(dflash_pair, prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in maxes], True, True, True)
    for (out, _, acc, _, _), p, m in zip(got, prompts, maxes):
        assert (out, acc) == reference_generate(dflash_pair, p, m, block_size=16)


SAMPLED_ROWS = {  # (temperature, top_p, top_k) a row; each set has a greedy row among its sampled ones
    "plain": [(0.0, 1.0, 0), (0.8, 1.0, 0), (1.3, 1.0, 0), (1.0, 1.0, 0), (0.5, 1.0, 0)],
    "filtered": [(0.9, 0.9, 0), (0.0, 1.0, 0), (1.2, 1.0, 5), (1.0, 1.0, 0), (0.6, 0.7, 3)],
}


def _host_sampled(pair, prompts, params, spec: bool):
    """An independent host path for sampled rows. DFlash: the two-pass step of an empty Seam (the draft's q and
    the verify's p on the host, guesses drawn and accepted there, keyed by the host's token index). Native: a
    loop written here, a forward and `sample_rows` a token (the host's draw, keyed by `next_index`)."""
    target = load_target(pair.target_dir)
    drafter = load_drafter(pair.draft_dir, target)
    runner = ModelRunner(target, 512, 16, taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(cuda_graphs=False, compile=False))
    if spec:
        seqs = generate(DFlashGenerator(runner, drafter, (), 16, seam=Seam()), prompts, params)
    else:
        gen = NativeGenerator(runner)
        seqs = gen.new_sequences(prompts, params)
        for sq in seqs:
            runner.allocator.ensure(sq.table, len(sq.prompt) + sq.params.max_tokens)
        gen.prefill(seqs)
        while live := [sq for sq in seqs if not sq.done]:
            out = runner.forward([sq.table for sq in live], [[sq.last_token] for sq in live], "last")
            for sq, tok in zip(live, sample_rows(out.logits[:, -1], live)):
                sq.commit([tok])
        for sq in seqs:
            runner.allocator.free(sq.table)
    assert runner.allocator.num_free == runner.allocator.num_blocks - 1, "blocks leaked"
    return [(sq.output, sq.finish_reason, sq.stats.acceptance_lengths, sq.stats.position_accepts,
             sq.stats.position_drafted) for sq in seqs]


@pytest.mark.parametrize("rows", list(SAMPLED_ROWS))
@pytest.mark.parametrize("spec", [True, False], ids=["dflash", "native"])
def test_sampled_rows_in_the_device_loop_equal_the_host_path(dflash_pair, spec, rows):  # noqa: F811
    """Sampled rows step in the device loop: drawn inside the captured step (counter-keyed draws, rejection
    sampling on the device, no host sync), they are the host path's tokens, acceptance and finishes (the
    device keys a draw by its state's P + 1, the host by prompt + output), a greedy row beside them stays
    greedy, and the graph path's padding rows change nothing; sessions of one step give them too."""
    prompts = _prompts(5, 23)
    params = [SamplingParams(max_tokens=n, temperature=t, top_p=tp, top_k=k, seed=100 + i, ignore_eos=True)
              for i, (n, (t, tp, k)) in enumerate(zip((3, 17, 40, 33, 25), SAMPLED_ROWS[rows]))]
    got = _run(dflash_pair, prompts, params, True, True, spec)
    assert got == _host_sampled(dflash_pair, prompts, params, spec)
    assert got == _run(dflash_pair, prompts, params, False, True, spec)
    greedy = [i for i, p in enumerate(params) if p.greedy][0]
    alone = _run(dflash_pair, [prompts[greedy]], [SamplingParams(max_tokens=params[greedy].max_tokens,
                                                                 ignore_eos=True)], False, False, spec)
    assert got[greedy] == alone[0]
    assert len({tuple(g[0][:3]) for g in got}) == 5, "rows look alike: is anything sampled?"
    if spec:
        sampled = [a for i, g in enumerate(got) if i != greedy for a in g[2]]
        assert max(sampled) > 1 and min(sampled) < 16, "the accept and the reject path both ran"


@pytest.mark.parametrize("spec", [True, False], ids=["dflash", "native"])
def test_the_first_step_is_queued_behind_the_prefill(dflash_pair, spec):  # noqa: F811
    """`generate` starts the device loop from the prefill's first tokens while they are still on the
    device (the scheduler's DeviceLoop.begin_after_prefill): the same tokens, finish reasons and acceptance as the sequential start
    (prefill, commit, then the loop), with a row whose first token is a stop token, and the time to first
    token recorded, greedy and sampled rows alike. A batch with a one-token request keeps the sequential start."""
    prompts = _prompts(4, 33)
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    runner = ModelRunner(target, 512, 16, taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(cuda_graphs=True, compile=False))
    starts = []

    def run(params, stops, overlap):
        gen = DFlashGenerator(runner, drafter, stops, 16) if spec else NativeGenerator(runner, stops)
        loop = gen.loop()
        begin = loop.begin_after_prefill
        loop.begin_after_prefill = lambda seqs, first: (starts.append(len(seqs)), begin(seqs, first))[1]
        if not overlap:
            gen.overlaps_start = lambda seqs: False
        seqs = generate(gen, prompts, params)
        assert gen._loop.sessions == 1  # one session of many steps
        assert all(s.stats.ttft_ms is not None and s.stats.ttft_ms <= s.stats.latency_ms for s in seqs)
        return [(s.output, s.finish_reason, s.stats.acceptance_lengths) for s in seqs]

    first = run([SamplingParams(max_tokens=30, ignore_eos=True)] * 4, (), True)[1][0][0]
    params = [SamplingParams(max_tokens=m) for m in (30, 30, 12, 25)]
    got = run(params, (first,), True)
    assert starts == [4, 4]
    want = run(params, (first,), False)
    assert starts == [4, 4], "the sequential start was not taken"
    assert got == want
    assert got[1][:2] == ([first], "stop")
    assert any(len(g[0]) > 1 for g in got)
    # sampled rows start from the prefill too: their first tokens are drawn on the device, unsynced
    sampled = [SamplingParams(max_tokens=m, temperature=t, top_p=tp, seed=i, ignore_eos=True)
               for i, (m, t, tp) in enumerate(((30, 0.9, 1.0), (20, 0.0, 1.0), (12, 1.2, 0.8), (25, 0.7, 1.0)))]
    got = run(sampled, (), True)
    assert starts == [4, 4, 4]
    assert got == run(sampled, (), False) and starts == [4, 4, 4]
    run([SamplingParams(max_tokens=m, ignore_eos=True) for m in (30, 1, 12, 25)], (), True)
    assert starts == [4, 4, 4], "a one-token request took the overlapped start"


def test_native_requests_launch_no_step_past_their_end(dflash_pair):  # noqa: F811
    """The host reads the step in flight before launching another once that step surely ends every row
    (native: one token to go; DFlash: one token to go too, as every step emits at least one), so such a
    request never waits for a wasted step. DFlash further from the end reads first only when the step in
    flight is likely to end it, so it may launch one step past the end there."""
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    runner = ModelRunner(target, 512, 16, taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(cuda_graphs=False, compile=False))
    prompts = _prompts(3, 5)
    for spec in (False, True):
        gen = DFlashGenerator(runner, drafter, (), 16) if spec else NativeGenerator(runner)
        wasted = []
        for n in (2, 9, 40):  # n = 2: the prefill's token, then one step that surely ends each row
            before = gen._loop.wasted_steps if gen._loop is not None else 0
            generate(gen, prompts, [SamplingParams(max_tokens=n, ignore_eos=True)] * 3)
            wasted.append(gen._loop.wasted_steps - before)
        assert gen._loop.sessions == 3
        assert wasted[0] == 0
        if not spec:
            assert wasted == [0, 0, 0]


def test_compiled_step_functions_trace_whole_and_give_the_eager_tokens(dflash_pair, monkeypatch):  # noqa: F811
    """What torch.compile fuses on a GPU (the layer functions, the final norm, the drafter's whole greedy pass
    with its argmax, its context K/V, the loop's bookkeeping) must trace as whole graphs, with the symbolic sizes
    ModelRunner.compiled asks for: dynamo traces them here (fullgraph, so a graph break fails) and runs the
    traced ATen ops without code generation. Two prompts in one device-loop session: a 150-token one, which
    prefills alone in two chunks (a fresh one, then one through the cache and the mask: a head count once derived
    from a symbolic length made SDPA's enable_gqa a SymBool, and every prefill after the first failed on the
    H200, which no single-shape test could see), and a 9-token one; they give the eager tokens and acceptance.
    One session of two rows, not one row at a time as well: batch 1 is a size dynamo specializes, so it would
    compile every function a second time (most of the suite's time), and every GPU run traces batch 1.
    (One test, not two: compiling with symbolic sizes takes most of its time.)"""
    import torch._dynamo  # noqa: PLC0415

    torch._dynamo.reset()
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 126, (n,), generator=g).tolist() for n in (150, 9)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (23, 30)]
    got = {}
    for comp in (True, False):
        # the graph path (on a CPU its functions run directly): prefills padded to 64 and 128 columns
        # prefill_chunk: the 150-token prompt is a fresh chunk of 128, then 22 through the mask
        runner = ModelRunner(target, 512, 16, taps=tuple(drafter.cfg.target_layer_ids),
                             config=RunnerConfig(cuda_graphs=True, compile=comp, compile_backend="aot_eager",
                                                 prefill_chunk=128))
        spec, native = DFlashGenerator(runner, drafter, (), 16), NativeGenerator(runner)
        before = sum(torch._dynamo.utils.counters["stats"].values())
        out = [(s.output, s.stats.acceptance_lengths) for s in generate(spec, prompts, params)]
        out += [(s.output, None) for s in generate(native, prompts, params)]
        assert (spec._loop.sessions, native._loop.sessions) == (1, 1)  # each generator's two rows: one session
        got[comp] = out
        if comp:
            assert sum(torch._dynamo.utils.counters["stats"].values()) > before, "nothing went through dynamo"
    assert got[True] == got[False]
    assert max(max(a) for _, a in got[True][:2]) > 1
    torch._dynamo.reset()


def test_dflash_rows_ending_at_the_last_position_stay_off_the_device_loop(dflash_pair, caplog):  # noqa: F811
    """A DFlash row's last step may commit one token past max_tokens (trimmed by the host), which leaves its state
    at its end position, and a step already queued behind it embeds that position: a row ending at the model's
    last position indexed past the RoPE table (a failed step here, a device-side assert on a GPU). Such rows run
    stepwise; rows ending one position short still take the loop. Both final norms zeroed, so every logit is 0:
    target and drafter both pick token 0 and every guess is accepted, the case that overshoots. Every run equals
    the stepwise loop, with no failed step."""
    from tests.dflash_fixtures import MAX_POS

    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    with torch.no_grad():
        target.norm.weight.zero_()
        drafter.norm.zero_()
    runner = ModelRunner(target, 512, 16, taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(cuda_graphs=False, compile=False))
    loop, stepwise = DFlashGenerator(runner, drafter, (), 16), DFlashGenerator(runner, drafter, (), 16)
    loop.device_loop, stepwise.device_loop = True, False
    g = torch.Generator().manual_seed(4)
    for n in (5, 20, 40):
        base = torch.randint(0, 126, (MAX_POS - n,), generator=g).tolist()
        for end, sessions in ((MAX_POS, 0), (MAX_POS - 1, 1)):
            prompt, params = base[:end - n], [SamplingParams(max_tokens=n, ignore_eos=True)]
            before = loop._loop.sessions if loop._loop is not None else 0
            caplog.clear()
            got = generate(loop, [prompt], params)[0]
            assert not [r for r in caplog.records if "failed" in r.getMessage()], (n, end, caplog.text[-500:])
            assert (loop._loop.sessions if loop._loop is not None else 0) - before == sessions, (n, end)
            want = generate(stepwise, [prompt], params)[0]
            assert (got.output, got.stats.acceptance_lengths) == (want.output, want.stats.acceptance_lengths)
            assert got.output == [0] * n and runner.allocator.num_free == runner.allocator.num_blocks - 1
            assert max(got.stats.acceptance_lengths) > 1, "nothing accepted: no step could overshoot"

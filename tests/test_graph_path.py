"""The CUDA-graph code path (bucketed batch and block padding, scratch slots, packed inputs, pending
draft rows) run eagerly on the CPU: it must give exactly what the unpadded path gives."""
from __future__ import annotations

import torch

from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.kv_cache import BlockTable
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator, Seam
from flashpd.engine.scheduler import generate

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 126, (int(k),), generator=g).tolist() for k in torch.randint(1, 200, (n,), generator=g)]


def test_padded_graph_path_equals_plain_path(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    taps = tuple(drafter.cfg.target_layer_ids)
    prompts = _prompts(5, 3)  # batch 5 pads to 8; block tables pad to a power of two
    params = [SamplingParams(max_tokens=37, ignore_eos=True)] * 5
    outs = {}
    for graphs in (False, True):
        runner = ModelRunner(target, 512, 16, taps=taps, config=RunnerConfig(cuda_graphs=graphs, compile=False))
        spec = generate(DFlashGenerator(runner, drafter, (), 16), prompts, params, draft_widths=[16, 4, 8, 16, 2])
        native = generate(NativeGenerator(runner), prompts, params)
        outs[graphs] = ([s.output for s in spec], [s.stats.acceptance_lengths for s in spec], [s.output for s in native])
    assert outs[True] == outs[False]
    assert outs[True][0] == outs[True][2]  # and DFlash equals native on the padded path too
    assert max(max(a) for a in outs[True][1]) > 1


def _two_pass(runner, drafter, stop_ids, width):
    """An empty seam: the model's own draft and acceptance as two passes with the host between (host-built
    inputs, runner.forward, the acceptance on the host), an independent path to compare with."""
    return DFlashGenerator(runner, drafter, stop_ids, width, seam=Seam())


def test_stepwise_device_step_equals_host_round_trip(dflash_pair):  # noqa: F811
    """A serving batch's stepwise steps are the device step in sessions of one (DeviceLoop.step): the same
    tokens and acceptance as the two-pass step with a host round trip, for rows of different draft widths in
    one step (each verifies its own width in the batch's widest graph) and rows narrowing near max_tokens."""
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    prompts = _prompts(3, 7)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 23, 31)]  # widths differ near the ends
    results, sessions = {}, {}
    for cls in ("device", "two-pass"):
        runner = ModelRunner(target, 512, 16, taps=tuple(drafter.cfg.target_layer_ids),
                             config=RunnerConfig(cuda_graphs=True, compile=False))
        gen = DFlashGenerator(runner, drafter, (), 16) if cls == "device" else _two_pass(runner, drafter, (), 16)
        gen.device_loop = False  # no multi-step sessions: every step is a stepwise one
        loop, keys = gen.loop(), sessions.setdefault(cls, [])
        begin = loop.begin
        loop.begin = lambda *a, begin=begin, keys=keys, **kw: keys.append(begin(*a, **kw)) or keys[-1]
        seqs = generate(gen, prompts, params, draft_widths=[16, 4, 8])
        results[cls] = ([s.output for s in seqs], [s.stats.acceptance_lengths for s in seqs])
    assert results["device"] == results["two-pass"]
    assert max(max(a) for a in results["two-pass"][1]) > 1
    steps = max(len(a) for a in results["device"][1])
    one = sessions["device"]
    assert len(one) >= steps and all(s.launched == 1 for s in one) and not sessions["two-pass"]
    assert all(s.width == max(s.widths) for s in one)
    assert {(s.width, tuple(s.widths)) for s in one if len(s.seqs) == 3} == {(16, (16, 4, 8))}


def test_short_prefill_replays_a_padded_graph(dflash_pair):  # noqa: F811
    """Prefills of a few hundred tokens (a prefix hit's tail, short prompts) pad to a multiple of 64 and run
    the graph path, with the last real column's logits picked inside it: same logits and taps as eager."""
    import flashpd.engine.runner as runner_mod
    target = load_target(dflash_pair.target_dir)
    taps = (0, 1)
    prompts = _prompts(3, 11)
    heads = [p[:len(p) // 3] for p in prompts]  # cached before the tail, as after a prefix hit
    got = {}
    for graphs in (False, True):
        runner = ModelRunner(target, 512, 16, taps=taps, config=RunnerConfig(cuda_graphs=graphs, compile=False))
        tables = [BlockTable() for _ in prompts]
        for tb, p in zip(tables, prompts):
            runner.allocator.ensure(tb, len(p))
        runner.forward(tables, heads, "none")
        tails = [p[len(h):] for p, h in zip(prompts, heads)]
        t = max(map(len, tails))
        assert runner._graph_width(len(tails), t, False, "last") == (runner_mod.bucket(t, 64) if graphs else 0)
        out = runner.forward(tables, tails, "last", taps=True)
        got[graphs] = (out.logits[:, -1], [torch.cat([x[j, :len(tl)] for x in out.taps], -1) for j, tl in enumerate(tails)])
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[True][1], got[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_short_equal_prefills_pad_to_16_or_32(dflash_pair):  # noqa: F811
    """Equal rows of 2-32 new tokens that want the last logits or none (short prompts, a hit's tail) ran at their
    own width: each of 31 widths a graph, captured inside the first such request's TTFT on a GPU. They pad to 16
    or 32 now, with eager's logits and taps; decode (one token) and verify ("all") keep their own widths."""
    import flashpd.engine.runner as runner_mod
    target = load_target(dflash_pair.target_dir)
    runner = ModelRunner(target, 512, 16, taps=(0, 1), config=RunnerConfig(cuda_graphs=True, compile=False))
    assert [runner._graph_width(2, t, True, "last") for t in (2, 5, 16, 17, 32)] == [16, 16, 16, 32, 32]
    assert runner._graph_width(1, 9, True, "none") == 16 and runner._graph_width(1, 1, True, "last") == 1
    assert [runner._graph_width(3, t, True, "all") for t in (1, 5, 16, 17)] == [1, 5, 16, 17]
    for n in (5, 20):
        prompts = [p[:n] for p in _prompts(8, 5) if len(p) >= n][:2]
        got = {}
        for graphs in (False, True):
            r = ModelRunner(target, 512, 16, taps=(0, 1), config=RunnerConfig(cuda_graphs=graphs, compile=False))
            tables = [BlockTable() for _ in prompts]
            for tb in tables:
                r.allocator.ensure(tb, n)
            out = r.forward(tables, prompts, "last", taps=True)
            got[graphs] = (out.logits[:, -1], [x[:, :n] for x in out.taps])
        assert runner_mod.bucket(n, 16) != n
        torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
        for a, b in zip(got[True][1], got[False][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_long_prompt_prefills_in_graph_width_chunks_with_the_one_forward_result(dflash_pair):  # noqa: F811
    """A lone prompt longer than prefill_chunk runs as consecutive padded graph-path chunks, each attending
    to the cache the earlier ones wrote: logits, hidden states and taps equal one forward's, and DFlash
    and native generation are unchanged (tokens and acceptance)."""
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    taps = tuple(drafter.cfg.target_layer_ids)
    prompt = _prompts(1, 11)[0] * 3  # well past the chunk width
    assert len(prompt) > 150
    plain = ModelRunner(target, 512, 16, taps=taps, config=RunnerConfig(cuda_graphs=False, compile=False))
    chunked = ModelRunner(target, 512, 16, taps=taps, config=RunnerConfig(cuda_graphs=True, compile=False))
    assert plain.config.prefill_chunk is None and chunked.config.prefill_chunk == 1024
    chunked.reconfigure(prefill_chunk=64)
    calls = []
    real = chunked._chunked
    chunked._chunked = lambda *a: calls.append(len(a[1])) or real(*a)
    outs = []
    for runner in (plain, chunked):
        table = BlockTable()
        runner.allocator.ensure(table, len(prompt))
        o = runner.forward([table], [prompt], "last", taps=True)
        assert table.num_tokens == len(prompt)
        outs.append(o)
        runner.allocator.free(table)
    assert calls == [len(prompt)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1].hidden, outs[0].hidden, rtol=1e-5, atol=1e-5)
    assert len(outs[1].taps) == len(taps)
    for a, b in zip(outs[1].taps, outs[0].taps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    prompts = [prompt[:40], prompt, prompt[:50]]  # the long one prefills alone (its own group), chunked
    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 3
    res = {}
    for name, runner in (("plain", plain), ("chunked", chunked)):
        spec = generate(DFlashGenerator(runner, drafter, (), 16), prompts, params)
        native = generate(NativeGenerator(runner), prompts, params)
        res[name] = ([s.output for s in spec], [s.stats.acceptance_lengths for s in spec], [s.output for s in native])
    assert calls == [len(prompt)] * 3  # the forward above, then DFlash's and native's prefill
    assert res["chunked"] == res["plain"] and res["chunked"][0] == res["chunked"][2]


def test_fresh_prefill_attends_causally_like_the_cache_path(dflash_pair):  # noqa: F811
    """A prompt with no cached prefix attends over its own K/V with a fused causal kernel
    (AttnBatch.fresh): the same hidden states, taps and logits as attention over the gathered cache
    under the position mask, for right-padded rows of different lengths; a prefix hit keeps the mask path."""
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    runner = ModelRunner(target, 256, 16, taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(cuda_graphs=True, compile=False))
    prompts = _prompts(3, 11)
    outs, seen = {}, []
    step = runner.model_step

    def spy(ids, pos, slots, bt, last=None, fresh=False):
        seen.append(fresh)
        return step(ids, pos, slots, bt, last, fresh)

    runner.model_step = spy
    for fresh in (True, False):
        tables = [BlockTable() for _ in prompts]
        for tb, p in zip(tables, prompts):
            runner.allocator.ensure(tb, len(p))
        ids, pos, slots, bt = (torch.as_tensor(x) for x in runner.batch_arrays(tables, prompts, 4, 200, 16))
        outs[fresh] = step(ids, pos, slots, bt, None, fresh)
        for tb in tables:
            runner.allocator.free(tb)
    # the cache path's o_proj sums per KV head (attention.out_proj), the fresh path's in one matmul: float32
    # rounding of a differently ordered sum, a few ulps of each tensor's scale
    def close(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())

    for r, p in enumerate(prompts):
        n = len(p)
        close(outs[True][0][r, :n], outs[False][0][r, :n])
        close(outs[True][2][r, :n], outs[False][2][r, :n])
        for a, b in zip(outs[True][1], outs[False][1]):
            close(a[r, :n], b[r, :n])
    # through forward: a fresh prompt takes the causal path; its cached tail (a prefix hit) does not
    seen.clear()
    table = BlockTable()
    runner.allocator.ensure(table, 150)
    runner.forward([table], [list(range(3, 103))], "last")
    runner.forward([table], [list(range(3, 53))], "last")
    assert seen == [True, False]


def test_prefill_writes_the_draft_context_inside_its_forwards(dflash_pair):  # noqa: F811
    """DFlash's prefill_request (the drafter's prompt context written by the prefill forwards themselves, in
    their graphs on a GPU) leaves the draft cache as the two-pass way does (prefill with taps, then
    write_prompt): a padded batch of several lengths (eager), one prompt in a padded graph, one prompt
    in graph-width chunks; the sink is part of each graph's key."""
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    taps = tuple(drafter.cfg.target_layer_ids)
    cases = [(False, None, _prompts(3, 11)), (True, None, _prompts(1, 12)), (True, 32, [list(range(1, 101))])]
    for graphs, chunk, prompts in cases:
        caches = []
        for fused in (False, True):
            runner = ModelRunner(target, 256, 16, taps=taps,
                                 config=RunnerConfig(cuda_graphs=graphs, compile=False, prefill_chunk=chunk))
            gen = DFlashGenerator(runner, drafter, (), 16)
            sinks: list[bool] = []  # per graphed forward, whether it carried the sink (graphs run eagerly here)
            graph = runner._graph
            graph.fn = lambda *a, fn=graph.fn, sinks=sinks, **kw: sinks.append(kw["sink"] is not None) or fn(*a, **kw)
            seqs = gen.new_sequences(prompts, [SamplingParams(max_tokens=4, ignore_eos=True)] * len(prompts))
            gen.reserve(seqs)
            if fused:
                gen.prefill_request(seqs)
            else:
                gen.drafts.write_prompt(seqs, gen.prefill(seqs, taps=True))
            assert [s.draft_len for s in seqs] == [len(p) for p in prompts]
            slots = [torch.tensor(gen.drafts._slots(s, 0, len(s.prompt))) for s in seqs]
            caches.append([gen.drafts.cache.data[:, :, :].flatten(2, 3)[:, :, sl] for sl in slots])
            # the graph path: every prefill forward a graph, each with the sink only when fused
            assert sinks == ([fused] * (-(-100 // chunk) if chunk else 1) if graphs else [])
        for a, b in zip(*caches):
            assert a.abs().sum() > 0
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_fresh_prompts_prefill_in_graph_sized_power_of_two_groups(dflash_pair):  # noqa: F811
    """With CUDA graphs, a batch of fresh prompts prefills in groups of 8, 4, 2, 1 prompts whose padded forward
    replays a graph (8 x 128 padded tokens at most here), not in one eager forward under the token budget (the
    path without graphs): a closed loop's admissions then replay graphs. Tokens and acceptance are unchanged."""
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    taps = tuple(drafter.cfg.target_layer_ids)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 126, (int(k),), generator=g).tolist() for k in torch.randint(65, 129, (15,), generator=g)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True)] * len(prompts)
    res, groups = {}, {}
    for graphs in (False, True):
        runner = ModelRunner(target, 4096, 16, taps=taps, config=RunnerConfig(cuda_graphs=graphs, compile=False))
        rows: list[tuple[int, int]] = []
        real = runner.forward

        def forward(tables, tokens, *a, _real=real, _rows=rows, **k):
            if all(tb.num_tokens == 0 for tb in tables):  # a fresh prefill (decode and verify extend a cache)
                _rows.append((len(tables), max(len(t) for t in tokens)))
            return _real(tables, tokens, *a, **k)
        runner.forward = forward
        spec = generate(DFlashGenerator(runner, drafter, (), 16), prompts, params)
        native = generate(NativeGenerator(runner), prompts, params)
        res[graphs] = ([s.output for s in spec], [s.stats.acceptance_lengths for s in spec], [s.output for s in native])
        groups[graphs] = rows
        if graphs:
            assert all(runner.replays_graph([len(p) for p in prompts[:b]]) for b in (1, 2, 4, 8))
            assert not runner.replays_graph([len(p) for p in prompts[:9]])  # 16 x 128 > prefill_graph_tokens
    assert [b for b, _ in groups[True]] == [8, 4, 2, 1] * 2  # DFlash's prefill, then native's
    assert [b for b, _ in groups[False]] == [15] * 2
    assert res[True] == res[False] and res[True][0] == res[True][2]

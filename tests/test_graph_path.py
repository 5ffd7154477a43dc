"""The CUDA-graph code path (bucketed batch and block padding, scratch slots, packed inputs, pending
draft rows) run eagerly on the CPU: it must give exactly what the unpadded path gives."""
from __future__ import annotations

import torch

from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator

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
        runner = ModelRunner(target, 512, 16, taps=taps, cuda_graphs=graphs, compile=False)
        spec = DFlashGenerator(runner, drafter, (), 16).generate(prompts, params, block_sizes=[16, 4, 8, 16, 2])
        native = NativeGenerator(runner).generate(prompts, params)
        outs[graphs] = ([s.output for s in spec], [s.stats.acceptance_lengths for s in spec], [s.output for s in native])
    assert outs[True] == outs[False]
    assert outs[True][0] == outs[True][2]  # and DFlash equals native on the padded path too
    assert max(max(a) for a in outs[True][1]) > 1


def test_single_sync_greedy_step_equals_host_round_trip(dflash_pair):  # noqa: F811
    """Greedy rows of one width skip the host between draft and verify (the draft's argmax is patched
    into the verify ids on the device): same tokens and acceptance as the two-sync step."""
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    prompts = _prompts(3, 7)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 23, 31)]  # widths differ near the ends
    results, tails = {}, []
    for one_sync in (True, False):
        runner = ModelRunner(target, 512, 16, taps=tuple(drafter.cfg.target_layer_ids), cuda_graphs=True, compile=False)
        forward = runner.forward

        def spy(*args, tail=None, **kw):
            if args[2:3] == ("all",):  # verify passes (prefill asks for the last logits only)
                tails.append((one_sync, tail is not None))
            return forward(*args, tail=tail, **kw)

        runner.forward = spy
        gen = DFlashGenerator(runner, drafter, (), 16)
        if not one_sync:
            gen._one_sync = lambda seqs, widths: False
        seqs = gen.generate(prompts, params)
        results[one_sync] = ([s.output for s in seqs], [s.stats.acceptance_lengths for s in seqs])
    assert results[True] == results[False]
    assert max(max(a) for a in results[True][1]) > 1
    # the single-sync step ran for every verify of the first run (rows near max_tokens, narrower than the
    # others, are padded to one shape), never in the second
    first = [t for s, t in tails if s]
    assert first and all(first) and not any(t for s, t in tails if not s)

"""DFlash greedy decoding is exact: token for token what flashpd's native greedy decoding emits.

Against NativeGenerator on the same runner (same target weights, same cache), over prompts of
1..500 tokens, block widths 2..16, batch 1 and batch 8 (mixed lengths in one generate call).
Then the two extreme drafters through an injected Seam (`DFlashGenerator(seam=...)`) (always wrong: tau == 1;
oracle: full blocks), and stop / max_tokens landing inside an accepted block.
"""
from __future__ import annotations

import pytest
import torch

from _dflash_helpers import (  # noqa: F401  (fixtures are used by name)
    Engine, dflash_engine, dflash_pair, greedy, oracle_acceptance, oracle_override, run_checked)
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate

WIDTHS = [2, 4, 8, 12, 16]
LENGTHS = [1, 2, 3, 5, 8, 13, 16, 17, 31, 47, 64, 97, 128, 150, 201, 256, 300, 377, 450, 500]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    order = torch.randperm(len(prompts), generator=g).tolist()  # batches of 8 get mixed lengths
    return [prompts[i] for i in order]


def _maxes(n: int) -> list[int]:
    return [32 + (7 * i) % 17 for i in range(n)]  # 32..48


@pytest.fixture(scope="module")
def exact_set(dflash_engine: Engine):
    prompts = _prompts(dflash_engine.vocab)
    maxes = _maxes(len(prompts))
    native = dflash_engine.native(prompts, maxes)
    assert [len(o) for o in native] == maxes
    return prompts, maxes, native


def _tau(seqs) -> float:
    al = [a for s in seqs for a in s.stats.acceptance_lengths]
    return sum(al) / len(al)


# ---- 2. exactness against native greedy ----------------------------------------------------------

@pytest.mark.parametrize("width", WIDTHS)
def test_batch8_equals_native_greedy(dflash_engine, exact_set, width):
    prompts, maxes, native = exact_set
    gen = dflash_engine.dflash(draft_width=width)
    seqs = []
    for i in range(0, len(prompts), 8):
        seqs += run_checked(gen, prompts[i:i + 8], [greedy(m) for m in maxes[i:i + 8]])
    for i, (s, want) in enumerate(zip(seqs, native)):
        assert s.output == want, (f"width {width}, prompt len {len(prompts[i])}: first difference at "
                                  f"{next(k for k, (a, b) in enumerate(zip(s.output, want)) if a != b)}")
        assert s.finish_reason == "length" and len(s.stats.acceptance_lengths) >= 1
    if width >= 4:
        assert _tau(seqs) > 1.2, "the drafter never got anything accepted: exactness is trivially true"


def test_batch1_equals_native_greedy(dflash_engine, exact_set):
    prompts, maxes, native = exact_set
    gens = {w: dflash_engine.dflash(draft_width=w) for w in WIDTHS}
    for i, (p, m, want) in enumerate(zip(prompts, maxes, native)):
        for w in (WIDTHS[i % 5], WIDTHS[(i + 2) % 5]):  # every prompt at two widths, every width 8 times
            s = run_checked(gens[w], [p], [greedy(m)])[0]
            assert s.output == want, f"width {w}, prompt len {len(p)}"


def test_mixed_widths_in_one_batch_equal_native(dflash_engine, exact_set):
    prompts, maxes, native = exact_set
    gen = dflash_engine.dflash()
    widths = [WIDTHS[i % 5] for i in range(8)]
    seqs = run_checked(gen, prompts[4:12], [greedy(m) for m in maxes[4:12]], draft_widths=widths)
    assert [s.output for s in seqs] == native[4:12]


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_tiny_max_tokens(dflash_engine, exact_set, max_tokens):
    """max_tokens 1 (prefill only, no step), 2 and 3 (one shrunken block)."""
    prompts, _, _ = exact_set
    ps = prompts[:8]
    native = dflash_engine.native(ps, max_tokens)
    seqs = run_checked(dflash_engine.dflash(draft_width=16), ps, [greedy(max_tokens)] * 8)
    assert [s.output for s in seqs] == native
    for s in seqs:
        assert s.finish_reason == "length"
        assert len(s.stats.acceptance_lengths) <= max_tokens - 1
        assert (s.stats.tau is None) == (max_tokens == 1)


# ---- 3. always-wrong and oracle drafters ----------------------------------------------------------

@pytest.mark.parametrize("width", [2, 4, 16])
def test_always_wrong_drafter_gives_tau_one(dflash_engine, exact_set, width):
    prompts, maxes, native = exact_set
    ps, ms, nat = prompts[:8], maxes[:8], native[:8]
    wrong = oracle_override({tuple(p): n for p, n in zip(ps, nat)}, shift=1, vocab=dflash_engine.vocab)
    gen = dflash_engine.dflash(draft_width=width, guesses=wrong)
    seqs = run_checked(gen, ps, [greedy(m) for m in ms])
    assert gen.seam.guesses.calls, "the override was never consulted"
    for s, m, want in zip(seqs, ms, nat):
        assert s.output == want
        assert s.stats.acceptance_lengths == [1] * (m - 1)
        assert s.stats.tau == 1.0
        assert sum(s.stats.position_accepts) == 0


@pytest.mark.parametrize("width", [2, 4, 12, 16])
def test_oracle_drafter_accepts_full_blocks(dflash_engine, exact_set, width):
    prompts, maxes, native = exact_set
    ps, ms, nat = prompts[8:16], maxes[8:16], native[8:16]
    gen = dflash_engine.dflash(draft_width=width, guesses=oracle_override({tuple(p): n for p, n in zip(ps, nat)}))
    seqs = run_checked(gen, ps, [greedy(m) for m in ms])
    for s, m, want in zip(seqs, ms, nat):
        assert s.output == want
        assert s.stats.acceptance_lengths == oracle_acceptance(m, width), (m, width)
        assert s.stats.position_accepts == s.stats.position_drafted
    # the last block shrinks to what can still be committed: never drafts past max_tokens
    assert max(gen.seam.guesses.calls) == width


def test_oracle_drafter_batch1_long_prompt(dflash_engine, exact_set):
    prompts, maxes, native = exact_set
    i = max(range(len(prompts)), key=lambda k: len(prompts[k]))  # the 500-token prompt
    gen = dflash_engine.dflash(draft_width=16, guesses=oracle_override({tuple(prompts[i]): native[i]}))
    s = run_checked(gen, [prompts[i]], [greedy(maxes[i])])[0]
    assert s.output == native[i]
    assert s.stats.acceptance_lengths == oracle_acceptance(maxes[i], 16)


# ---- 4. stop tokens and max_tokens inside a block ------------------------------------------------

def _stop_inside_block(nat: list[int], width: int, lo: int) -> int | None:
    """An output index j >= lo whose token is new (first occurrence) and that the oracle commits
    strictly inside a block (neither the bonus at a block's end nor a block's first token)."""
    for j in range(lo, len(nat)):
        if nat[j] not in nat[:j] and 1 <= (j - 1) % width <= width - 2:
            return j
    return None


@pytest.mark.parametrize("width", [4, 8, 16])
def test_stop_token_inside_accepted_block(dflash_engine, exact_set, width):
    prompts, maxes, native = exact_set
    found = 0
    for p, m, nat in zip(prompts, maxes, native):
        j = _stop_inside_block(nat, width, lo=width + 1)
        if j is None:
            continue
        found += 1
        stop = nat[j]
        gen = dflash_engine.dflash(stop_ids=[stop], draft_width=width, guesses=oracle_override({tuple(p): nat}))
        s = run_checked(gen, [p], [greedy(m, ignore_eos=False)])[0]
        assert s.output == nat[:j + 1], "output must end exactly at (and include) the first stop token"
        assert s.finish_reason == "stop"
        assert s.stats.acceptance_lengths == oracle_acceptance(m, width, stop_at=j)
        assert s.stats.acceptance_lengths[-1] < width  # the stop cut an accepted block short
        # the same request natively stops at the same place
        assert dflash_engine.native([p], m, stop_ids=[stop], ignore_eos=False)[0] == nat[:j + 1]
        # ignore_eos: the stop token is just a token
        s = run_checked(gen, [p], [greedy(m, ignore_eos=True)])[0]
        assert s.output == nat and s.finish_reason == "length"
        if found == 3:
            break
    assert found, "no prompt had a fresh token strictly inside a block"


def test_stop_tokens_with_trained_drafter_batch(dflash_engine, exact_set):
    """Real drafter, batch of 8, two stop ids: each row stops where native decoding stops."""
    prompts, maxes, native = exact_set
    ps, ms = prompts[:8], [48] * 8
    nat = dflash_engine.native(ps, ms)
    stops = {nat[0][20], nat[3][9]}  # tokens that occur in these continuations
    want = dflash_engine.native(ps, ms, stop_ids=stops, ignore_eos=False)
    seqs = run_checked(dflash_engine.dflash(stop_ids=stops, draft_width=8), ps,
                       [greedy(m, ignore_eos=False) for m in ms])
    n_stopped = 0
    for s, w in zip(seqs, want):
        assert s.output == w
        hit = [k for k, t in enumerate(s.output) if t in stops]
        if hit:
            n_stopped += 1
            assert hit == [len(s.output) - 1] and s.finish_reason == "stop", "no token after the stop token"
        else:
            assert s.finish_reason == "length"
    assert n_stopped >= 2


def test_stop_token_as_first_token(dflash_engine, exact_set):
    prompts, maxes, native = exact_set
    p, nat = prompts[2], native[2]
    gen = dflash_engine.dflash(stop_ids=[nat[0]], draft_width=16)
    s = run_checked(gen, [p], [greedy(40, ignore_eos=False)])[0]
    assert s.output == [nat[0]] and s.finish_reason == "stop"
    assert s.stats.acceptance_lengths == [] and s.stats.tau is None


@pytest.mark.parametrize("width,max_tokens", [(8, 20), (16, 27), (4, 31), (12, 12)])
def test_max_tokens_inside_block(dflash_engine, exact_set, width, max_tokens):
    """(max_tokens - 1) % width != 0: the last block is clipped at exactly max_tokens."""
    assert (max_tokens - 1) % width
    prompts, _, _ = exact_set
    ps = prompts[10:18]
    nat = dflash_engine.native(ps, max_tokens)
    # oracle: the final verify step shrinks to the remaining tokens
    gen = dflash_engine.dflash(draft_width=width, guesses=oracle_override({tuple(p): n for p, n in zip(ps, nat)}))
    for s, want in zip(run_checked(gen, ps, [greedy(max_tokens)] * 8), nat):
        assert s.output == want and len(s.output) == max_tokens
        assert s.finish_reason == "length"
        assert s.stats.acceptance_lengths == oracle_acceptance(max_tokens, width)
        assert s.stats.acceptance_lengths[-1] == (max_tokens - 1) % width
    # trained drafter
    for s, want in zip(run_checked(dflash_engine.dflash(draft_width=width), ps, [greedy(max_tokens)] * 8), nat):
        assert s.output == want and s.finish_reason == "length"


def test_generator_refuses_bad_draft_widths(dflash_engine):
    with pytest.raises(ValueError, match="block_size"):
        dflash_engine.dflash(draft_width=17)
    with pytest.raises(ValueError, match="block_size"):
        generate(dflash_engine.dflash(), [[1, 2, 3]], [SamplingParams(max_tokens=4)], draft_widths=[1])


def test_stop_at_first_token_for_one_row_of_a_batch(dflash_engine, exact_set):
    """A row finished by prefill is dropped before the first draft; the others carry on unchanged."""
    prompts, _, _ = exact_set
    ps = prompts[:6]
    nat = dflash_engine.native(ps, 40)
    stop = nat[2][0]
    want = dflash_engine.native(ps, 40, stop_ids=[stop], ignore_eos=False)
    assert want[2] == [stop] and any(len(w) > 1 for w in want)
    seqs = run_checked(dflash_engine.dflash(stop_ids=[stop], draft_width=8), ps, [greedy(40, ignore_eos=False)] * 6)
    assert [s.output for s in seqs] == want
    assert seqs[2].finish_reason == "stop" and seqs[2].stats.acceptance_lengths == []


def test_greedy_rows_stay_exact_next_to_sampled_rows(dflash_engine, exact_set):
    prompts, maxes, native = exact_set
    ps, ms = prompts[:8], maxes[:8]
    params = [greedy(m) if i % 2 == 0 else
              SamplingParams(max_tokens=m, temperature=1.0, top_k=20, seed=i, ignore_eos=True)
              for i, m in enumerate(ms)]
    seqs = run_checked(dflash_engine.dflash(draft_width=8), ps, params)
    for i, s in enumerate(seqs):
        if i % 2 == 0:
            assert s.output == native[i]
        else:
            assert len(s.output) == ms[i]


def test_row_near_position_limit_next_to_a_wide_row(dflash_engine):
    """Row A ends exactly at the position limit (its last blocks shrink); row B still drafts 16 wide."""
    limit = dflash_engine.runner.max_positions
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, dflash_engine.vocab, (limit - 12,), generator=g).tolist()
    b = torch.randint(0, dflash_engine.vocab, (20,), generator=g).tolist()
    want = dflash_engine.native([a, b], [12, 40])
    seqs = run_checked(dflash_engine.dflash(draft_width=16), [a, b], [greedy(12), greedy(40)])
    assert [s.output for s in seqs] == want


def test_row_at_position_limit_alone(dflash_engine):
    """Control for the test above: alone, the same row decodes exactly up to the last position."""
    limit = dflash_engine.runner.max_positions
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, dflash_engine.vocab, (limit - 12,), generator=g).tolist()
    want = dflash_engine.native([a], 12)
    assert run_checked(dflash_engine.dflash(draft_width=16), [a], [greedy(12)])[0].output == want[0]

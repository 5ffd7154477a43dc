"""DFlash parity with the reference implementation (dflash==0.1.0), float32 on CPU.

The pair (tests/dflash_fixtures.py) is a tiny HF Qwen3 target and a reference
`dflash.model.DFlashDraftModel` briefly trained on the target's greedy continuations. flashpd
loads both from their saved directories with its own loaders and must reproduce
(a) the reference drafter's block logits (drafter forward + target lm_head) for a given context,
(b) the reference `dflash_generate`'s greedy tokens AND per-step acceptance lengths.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _dflash_helpers import (  # noqa: F401  (fixtures are used by name)
    Engine, Pair, dflash_engine, dflash_pair, greedy, plain_greedy, reference_generate, run_checked,
    target_features)
from conftest import assert_fp32_close
from flashpd.engine.drafter import load_drafter
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.sequence import Sequence



# ---- (a) one draft pass ---------------------------------------------------------------------------

@torch.no_grad()
def reference_draft_logits(pair: Pair, feats: torch.Tensor, first: int, width: int) -> torch.Tensor:
    """What dflash_generate computes for a block [first, MASK x (width-1)] at positions P..P+width-1
    with context taps feats [P, F] (positions 0..P-1): drafter forward, then compute_logits with the
    target's lm_head, for block positions 1..width-1 -> [width-1, V]."""
    ref, tgt = pair.ref_drafter, pair.hf_target
    p = feats.shape[0]
    ids = torch.full((1, width), pair.mask_token_id, dtype=torch.long)
    ids[0, 0] = first
    emb = F.embedding(ids, tgt.get_input_embeddings().weight)
    hidden = ref(target_hidden=feats[None], noise_embedding=emb, position_ids=torch.arange(p + width)[None])
    return ref.compute_logits(hidden[:, 1:], tgt.lm_head)[0].float()


def engine_draft_logits(eng: Engine, items: list[tuple[list[int], torch.Tensor, int, int, int]]) -> list[torch.Tensor]:
    """flashpd's draft pass for several sequences in ONE DraftRunner.draft call.

    items: (prompt, feats [P, F], first token, width, n_pending). The first P - n_pending context
    rows go in through write_prompt; the last n_pending arrive as `pending` rows (the path a verify
    step takes), padded with random junk rows that must never reach the cache."""
    gen = eng.dflash()
    alloc = eng.runner.allocator
    seqs = []
    try:
        for prompt, feats, first, width, _ in items:
            s = Sequence(list(prompt), greedy(64), frozenset())
            s.output = [first]
            alloc.ensure(s.table, feats.shape[0] + width)
            s.table.num_tokens = feats.shape[0]  # target cache holds positions 0..P-1; `first` sits at P
            seqs.append(s)
        gen.drafts.write_prompt(seqs, [f[:f.shape[0] - n] for _, f, _, _, n in items])
        junk = torch.Generator().manual_seed(7)
        for s, (_, f, _, _, n) in zip(seqs, items):
            if n:
                pad = torch.randn(3, f.shape[1], generator=junk) * 5
                s.pending, s.pending_rows = torch.cat([f[f.shape[0] - n:], pad]), n
        logits = gen.drafts.draft(seqs, [it[3] for it in items])
        return [logits[i, :it[3] - 1].float() for i, it in enumerate(items)]
    finally:
        for s in seqs:
            alloc.free(s.table)


def _feats(pair: Pair, prompt: list[int]) -> torch.Tensor:
    return target_features(pair.hf_target, torch.tensor([prompt]))[0]


@pytest.mark.parametrize("n_pending", [0, 1, 5])
@pytest.mark.parametrize("prompt_index,width", [(0, 16), (2, 4), (4, 7), (7, 16), (5, 2)])
def test_draft_logits_match_reference(dflash_pair, dflash_engine, prompt_index, width, n_pending):
    pair = dflash_pair
    prompt = pair.prompts[prompt_index]
    feats = _feats(pair, prompt)
    first = plain_greedy(pair, prompt, 1)[0]
    want = reference_draft_logits(pair, feats, first, width)
    got = engine_draft_logits(dflash_engine, [(prompt, feats, first, width, n_pending)])[0]
    assert got.shape == want.shape == (width - 1, dflash_engine.vocab)
    assert_fp32_close(got, want, msg=lambda m: f"draft logits (P={len(prompt)}, width={width}): {m}")
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_draft_logits_batch_of_mixed_rows_match_reference(dflash_pair, dflash_engine):
    """One draft pass over rows of different context lengths, widths and pending counts: each row
    equals its own reference (shorter rows mask the tail block keys, contexts stay separate)."""
    pair = dflash_pair
    spec = [(1, 16, 0), (3, 5, 2), (0, 2, 1), (6, 9, 4), (7, 12, 0)]
    items = []
    for idx, width, n_pending in spec:
        prompt = pair.prompts[idx]
        items.append((prompt, _feats(pair, prompt), (prompt[-1] * 7 + 3) % (pair.mask_token_id), width, n_pending))
    got = engine_draft_logits(dflash_engine, items)
    for (prompt, feats, first, width, _), g in zip(items, got):
        want = reference_draft_logits(pair, feats, first, width)
        assert_fp32_close(g, want, msg=lambda m: f"P={len(prompt)} width={width}: {m}")


def test_prefill_taps_match_hf_hidden_states(dflash_pair, dflash_engine):
    """The features the drafter conditions on: tap j = HF hidden_states[j + 1], concatenated in order."""
    pair, eng = dflash_pair, dflash_engine
    prompts = [pair.prompts[i] for i in (0, 3, 6)]
    gen = eng.dflash()
    seqs = gen.new_sequences(prompts, [greedy(1)] * len(prompts))
    feats = gen.prefill(seqs, taps=True)
    for s in seqs:
        gen.finish(s)
    for p, f in zip(prompts, feats):
        want = _feats(pair, p)
        assert f.shape == want.shape
        assert_fp32_close(f, want, msg=lambda m: f"taps vs HF hidden_states[j+1]: {m}")


# ---- (b) whole generations ------------------------------------------------------------------------

def _max_tokens(i: int) -> int:
    return 37 + 5 * i  # 37..72: ends at assorted offsets inside blocks of 4 and 16


def _check_acceptance_is_informative(all_lengths: list[list[int]], width: int) -> None:
    flat = [a for al in all_lengths for a in al]
    tau = sum(flat) / len(flat)
    longer = sum(a > 1 for a in flat) / len(flat)
    assert max(flat) >= min(width, 4) and longer >= 0.2 and tau >= 1.3, (
        f"the fixture drafter barely accepts (tau {tau:.2f}, {longer:.0%} steps > 1): parity would prove little")


@pytest.mark.parametrize("width", [16, 4])
def test_generate_matches_reference_dflash_generate(dflash_pair, dflash_engine, width):
    pair, eng = dflash_pair, dflash_engine
    prompts = pair.prompts
    maxes = [_max_tokens(i) for i in range(len(prompts))]
    refs = [reference_generate(pair, p, m, block_size=width) for p, m in zip(prompts, maxes)]
    for (ids, al), m in zip(refs, maxes):
        assert len(ids) == m and sum(al) == m - 1
    _check_acceptance_is_informative([al for _, al in refs], width)

    gen = eng.dflash(draft_width=width)
    # batch 1
    for i, (p, m, (ids, al)) in enumerate(zip(prompts, maxes, refs)):
        s = run_checked(gen, [p], [greedy(m)])[0]
        assert s.output == ids, f"prompt {i} (len {len(p)}): tokens differ from dflash_generate"
        assert s.stats.acceptance_lengths == al, f"prompt {i}: acceptance {s.stats.acceptance_lengths} != {al}"
        assert s.finish_reason == "length"
    # all prompts (lengths 5..300) in one batch
    seqs = run_checked(gen, prompts, [greedy(m) for m in maxes])
    for i, (s, (ids, al)) in enumerate(zip(seqs, refs)):
        assert s.output == ids, f"batch row {i}: tokens differ from dflash_generate"
        assert s.stats.acceptance_lengths == al, f"batch row {i}: acceptance lengths differ"


def test_mixed_draft_widths_in_one_batch_match_reference(dflash_pair, dflash_engine):
    """Per-request draft widths (generate(draft_widths=...)): each row follows the reference at its width."""
    pair, eng = dflash_pair, dflash_engine
    widths = [8, 3, 16, 5, 2, 12, 8, 16]
    prompts = pair.prompts
    maxes = [41, 50, 33, 47, 29, 60, 45, 53]
    seqs = run_checked(eng.dflash(), prompts, [greedy(m) for m in maxes], draft_widths=widths)
    for i, (s, p, m, w) in enumerate(zip(seqs, prompts, maxes, widths)):
        ids, al = reference_generate(pair, p, m, block_size=w)
        assert s.draft_width == w
        assert (s.output, s.stats.acceptance_lengths) == (ids, al), f"row {i} (width {w}) differs"


def test_reference_and_dflash_equal_plain_greedy(dflash_pair, dflash_engine):
    """Sanity of the oracle itself: the reference's DFlash output is the target's plain greedy output."""
    pair = dflash_pair
    for p in pair.prompts[:3]:
        ids, _ = reference_generate(pair, p, 40)
        assert ids == plain_greedy(pair, p, 40)
        assert run_checked(dflash_engine.dflash(), [p], [greedy(40)])[0].output == ids


# ---- a drafter unlike the fixture's: every optional branch of the config ------------------------

@pytest.fixture(scope="module")
def exotic_pair(dflash_pair, tmp_path_factory):
    """A random (untrained) reference drafter for the fixture target with: 2 layers, head_dim 32 != the
    target's 16 and rope_theta 1e6 (so flashpd builds the drafter its own RoPE table), 1 KV head,
    taps [4, 1] (unsorted, and including the target's LAST layer, whose HF hidden state is after the
    final norm), input_embedding_scale / output_multiplier / final_logit_softcapping, block size 8,
    random norm weights and large projections (swapped or skipped weights would show)."""
    import dataclasses

    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    pair = dflash_pair
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                      rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      tie_word_embeddings=False, architectures=["DFlashDraftModel"], num_target_layers=5,
                      block_size=8, dflash_config={"mask_token_id": pair.mask_token_id, "target_layer_ids": [4, 1],
                                                   "input_embedding_scale": 1.5, "output_multiplier": 0.7,
                                                   "final_logit_softcapping": 20.0})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        ref = DFlashDraftModel(cfg).float().eval()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.15)
    d = tmp_path_factory.mktemp("exotic") / "drafter"
    ref.save_pretrained(d)
    ref.requires_grad_(False)
    return dataclasses.replace(pair, draft_dir=d, ref_drafter=ref, block_size=8,
                               target_layer_ids=[4, 1])


@torch.no_grad()
def _exotic_reference_logits(pair, feats, first, width):
    ref, tgt = pair.ref_drafter, pair.hf_target
    p = feats.shape[0]
    ids = torch.full((1, width), pair.mask_token_id, dtype=torch.long)
    ids[0, 0] = first
    emb = F.embedding(ids, tgt.get_input_embeddings().weight) * 1.5  # dflash_generate's input_embedding_scale
    hidden = ref(target_hidden=feats[None], noise_embedding=emb, position_ids=torch.arange(p + width)[None])
    return ref.compute_logits(hidden[:, 1:], tgt.lm_head)[0].float()


def test_exotic_drafter_draft_logits_and_generation_match_reference(exotic_pair, dflash_engine):
    pair = exotic_pair
    drafter = load_drafter(pair.draft_dir, dflash_engine.target)
    assert drafter.cfg.target_layer_ids == (4, 1) and drafter.cfg.head_dim == 32
    assert drafter.rotary is not dflash_engine.target.rotary
    runner = ModelRunner(dflash_engine.target, num_blocks=256, kv_block_size=16, taps=(4, 1),
                         config=RunnerConfig(cuda_graphs=False))
    eng = Engine(pair, dflash_engine.target, drafter, runner)
    # the features flashpd conditions on, in the drafter's tap order [4, 1], from a prefill and from a
    # verify-shaped forward (block of 6 tokens after the prompt)
    prompt, block = pair.prompts[3], [5, 9, 2, 77, 31, 8]
    full = target_features(pair.hf_target, torch.tensor([prompt + block]), layer_ids=[4, 1])[0]
    gen = eng.dflash()
    seq = gen.new_sequences([prompt], [greedy(2)])[0]
    runner.allocator.ensure(seq.table, len(prompt) + len(block))
    pre = runner.forward([seq.table], [prompt], "last", taps=True)
    ver = runner.forward([seq.table], [block], "all", taps=True)
    runner.allocator.free(seq.table)
    for got, want in ((torch.cat(pre.taps, -1)[0], full[:len(prompt)]), (torch.cat(ver.taps, -1)[0], full[len(prompt):])):
        assert_fp32_close(got, want, msg=lambda m: f"runner taps differ from HF hidden_states[j + 1]: {m}")
    items = []
    for idx, width, n_pending in [(0, 8, 0), (4, 3, 2), (6, 16, 1)]:
        prompt = pair.prompts[idx]
        feats = target_features(pair.hf_target, torch.tensor([prompt]), layer_ids=[4, 1])[0]
        items.append((prompt, feats, (prompt[0] + 11) % 126, width, n_pending))
    got = engine_draft_logits(eng, items)
    for (prompt, feats, first, width, _), g in zip(items, got):
        want = _exotic_reference_logits(pair, feats, first, width)
        assert want.abs().max() <= 20.0  # the softcap is in force
        assert_fp32_close(g, want, msg=lambda m: f"P={len(prompt)} width={width}: {m}")
    # whole generations: tokens and acceptance lengths of dflash_generate (default block 8 and 5)
    for width in (None, 5):
        gen = eng.dflash(draft_width=width)
        for p in pair.prompts[:4]:
            s = run_checked(gen, [p], [greedy(30)])[0]
            assert (s.output, s.stats.acceptance_lengths) == reference_generate(pair, p, 30, width)

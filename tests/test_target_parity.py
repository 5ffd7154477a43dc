"""The engine's Qwen3 target over the paged KV cache vs transformers' Qwen3ForCausalLM (float32, CPU).

The oracle is always HF run on each sequence alone and unpadded; the engine runs batches of
mixed lengths through `ModelRunner.forward` / `NativeGenerator.generate`.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_fp32_close, hf_greedy, hf_logits, new_runner, random_prompts
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.kv_cache import BlockTable
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate


# name -> checkpoint options (conftest.TINY holds the defaults: vocab 256, hidden 64, ...).
CONFIGS = {
    # GQA 4:1, head_dim 24 != 64/4, tied head
    "tied-gqa4to1-hd24-L2": dict(tie=True, layers=2, heads=4, kv_heads=1, hidden=64, head_dim=24),
    # plain multi-head (1:1), head_dim = hidden/heads, untied
    "untied-mha-L1": dict(tie=False, layers=1, heads=4, kv_heads=4, hidden=64, head_dim=None),
    # GQA 4:1, head_dim 24, 4 layers, untied
    "untied-gqa4to1-hd24-L4": dict(tie=False, layers=4, heads=4, kv_heads=1, hidden=64, head_dim=24),
    # 8 heads over 2 kv heads, hidden 96, tied
    "tied-gqa4to1-h8-L4": dict(tie=True, layers=4, heads=8, kv_heads=2, hidden=96, head_dim=None),
    # 6 heads over 3 kv heads (2:1), head_dim 12 != 48/6 = 8, vocab 128
    "untied-gqa2to1-h6-hd12-L2": dict(tie=False, layers=2, heads=6, kv_heads=3, hidden=48, head_dim=12,
                                      intermediate=64, vocab=128),
    # 2 heads, head_dim 40 > hidden/heads (32/2 = 16), 1:1, tied, vocab 200
    "tied-mha-h2-hd40-L1": dict(tie=True, layers=1, heads=2, kv_heads=2, hidden=32, head_dim=40, vocab=200),
}


def _ensure(runner, tables, lengths):
    for t, n in zip(tables, lengths):
        runner.allocator.ensure(t, t.num_tokens + n)


@pytest.mark.parametrize("name,kv_block_size", [(n, 16) for n in CONFIGS] + [
    ("tied-gqa4to1-hd24-L2", 3),   # odd block size: blocks straddle every boundary
    ("untied-gqa4to1-hd24-L4", 1),  # one position per block: longest block tables
])
def test_prefill_and_decode_logits_match_hf(make_checkpoint, name, kv_block_size):
    spec = CONFIGS[name]
    hf, d = make_checkpoint(**spec)
    vocab = hf.config.vocab_size
    steps = 32
    runner = new_runner(d, num_blocks=(301 + 33 + 7 + 1 + 4 * steps) // kv_block_size + 16,
                        kv_block_size=kv_block_size)
    prompts = random_prompts([1, 7, 33, 301], vocab, seed=11)
    conts = [hf_greedy(hf, p, steps) for p in prompts]          # HF's own greedy tokens
    refs = [hf_logits(hf, p + c) for p, c in zip(prompts, conts)]  # [len(p)+steps, V] each

    tables = [BlockTable() for _ in prompts]
    _ensure(runner, tables, [len(p) for p in prompts])
    out = runner.forward(tables, prompts, want_logits="all")
    assert out.logits.shape == (len(prompts), max(map(len, prompts)), vocab)
    for i, p in enumerate(prompts):
        assert_fp32_close(out.logits[i, :len(p)], refs[i][:len(p)], msg=f"prefill row {i} (len {len(p)})")
        assert tables[i].num_tokens == len(p)

    # decode: feed each sequence HF's greedy token, compare the next logits at every step
    for k in range(steps):
        _ensure(runner, tables, [1] * len(prompts))
        out = runner.forward(tables, [[c[k]] for c in conts], want_logits="last")
        assert out.logits.shape == (len(prompts), 1, vocab)
        for i, p in enumerate(prompts):
            ref = refs[i][len(p) + k]
            assert_fp32_close(out.logits[i, 0], ref, msg=f"decode step {k} row {i} (len {len(p)})")
            if k + 1 < steps:
                assert out.logits[i, 0].argmax().item() == conts[i][k + 1]


def test_prefill_last_logits_equal_all_logits_at_last_position(make_checkpoint):
    hf, d = make_checkpoint(**CONFIGS["tied-gqa4to1-hd24-L2"])
    prompts = random_prompts([5, 1, 40], hf.config.vocab_size, seed=3)
    outs = {}
    for mode in ("all", "last"):
        runner = new_runner(d, num_blocks=32)
        tables = [BlockTable() for _ in prompts]
        _ensure(runner, tables, [len(p) for p in prompts])
        outs[mode] = runner.forward(tables, prompts, want_logits=mode).logits
    for i, p in enumerate(prompts):
        assert_fp32_close(outs["last"][i, 0], outs["all"][i, len(p) - 1])
        assert_fp32_close(outs["last"][i, 0], hf_logits(hf, p)[-1])


def test_chunked_prefill_matches_hf(make_checkpoint):
    """A prompt fed in several multi-token chunks (odd block size) equals HF's one-shot forward."""
    hf, d = make_checkpoint(**CONFIGS["untied-gqa4to1-hd24-L4"])
    runner = new_runner(d, num_blocks=64, kv_block_size=5)
    (p,) = random_prompts([57], hf.config.vocab_size, seed=4)
    ref = hf_logits(hf, p)
    table, got, start = BlockTable(), [], 0
    for n in (13, 1, 20, 23):
        _ensure(runner, [table], [n])
        got.append(runner.forward([table], [p[start:start + n]], want_logits="all").logits[0])
        start += n
    assert_fp32_close(torch.cat(got), ref)


GREEDY_LENGTHS = [1, 7, 64, 130, 301]


@pytest.mark.parametrize("name,budget", [
    ("tied-gqa4to1-hd24-L2", 8192),
    ("untied-mha-L1", 8192),
    ("tied-gqa4to1-h8-L4", 8192),
    ("untied-gqa4to1-hd24-L4", 400),  # the batch splits into several padded prefill groups
])
def test_greedy_64_tokens_match_hf_generate(make_checkpoint, name, budget):
    hf, d = make_checkpoint(**CONFIGS[name])
    prompts = random_prompts(GREEDY_LENGTHS, hf.config.vocab_size, seed=21)
    expected = [hf_greedy(hf, p, 64) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)
    runner = new_runner(d, num_blocks=160)
    free0 = runner.allocator.num_free
    gen = NativeGenerator(runner, stop_ids=(), prefill_token_budget=budget)
    seqs = generate(gen, prompts, [SamplingParams(max_tokens=64, ignore_eos=True)] * len(prompts))
    for s, p, e in zip(seqs, prompts, expected):
        assert s.prompt == p
        assert s.output == e, f"prompt len {len(p)}: first mismatch at " \
            f"{next(i for i, (a, b) in enumerate(zip(s.output, e)) if a != b)}"
        assert s.finish_reason == "length"
    assert runner.allocator.num_free == free0  # every finished sequence gave its blocks back


def test_batch_size_independence(make_checkpoint):
    hf, d = make_checkpoint(**CONFIGS["untied-gqa4to1-hd24-L4"])
    vocab = hf.config.vocab_size
    (q,) = random_prompts([37], vocab, seed=5)
    others = random_prompts([5, 200, 1], vocab, seed=6)
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    alone = generate(NativeGenerator(new_runner(d, num_blocks=64)), [q], [sp])[0].output
    batch = [others[0], q, others[1], others[2]]
    together = generate(NativeGenerator(new_runner(d, num_blocks=96)), batch, [sp] * len(batch))
    assert together[1].output == alone
    assert alone == hf_greedy(hf, q, 48)
    # and the same prompt twice in one batch, next to different neighbours
    twice = generate(NativeGenerator(new_runner(d, num_blocks=96)), [q, others[1], q], [sp] * 3)
    assert twice[0].output == alone and twice[2].output == alone

    # logits too: the prompt's prefill logits alone vs padded inside the mixed batch
    r1, r2 = new_runner(d, num_blocks=64), new_runner(d, num_blocks=96)
    t1 = [BlockTable()]
    _ensure(r1, t1, [len(q)])
    l1 = r1.forward(t1, [q], want_logits="all").logits[0]
    t2 = [BlockTable() for _ in batch]
    _ensure(r2, t2, [len(p) for p in batch])
    l2 = r2.forward(t2, batch, want_logits="all").logits[1, :len(q)]
    assert_fp32_close(l2, l1)


# ---- paged cache: truncate (speculative rollback) and block reuse -----------------------------

def _history_chunks(prompt, went, n):
    """The chunks a sequence was fed (prompt, then one token per decode step), cut at position n."""
    return [c for c in [prompt[:n]] + [[t] for t in went[:max(0, n - len(prompt))]] if c]


def _feed(runner, table, chunks):
    """Feed token chunks to one sequence; return the logits of every fed token, [sum, V]."""
    got = []
    for chunk in chunks:
        _ensure(runner, [table], [len(chunk)])
        got.append(runner.forward([table], [chunk], want_logits="all").logits[0])
    return torch.cat(got)


@pytest.mark.parametrize("n", [27, 24, 10])  # mid-block, on a block boundary, back inside the prompt
def test_truncate_then_decode_equals_fresh_sequence(make_checkpoint, n):
    hf, d = make_checkpoint(**CONFIGS["tied-gqa4to1-hd24-L2"])
    vocab, bs = hf.config.vocab_size, 4
    prompt, went, new = random_prompts([21, 20, 9], vocab, seed=7)
    history = prompt + went  # 41 positions

    runner = new_runner(d, num_blocks=32, kv_block_size=bs)
    a = BlockTable()
    _feed(runner, a, [prompt] + [[t] for t in went])          # prefill, then 20 decode steps
    assert a.num_tokens == 41 and len(a.blocks) == 11
    free_before = runner.allocator.num_free
    runner.allocator.truncate(a, n)
    assert a.num_tokens == n
    assert len(a.blocks) == -(-n // bs)
    assert runner.allocator.num_free == free_before + (11 - -(-n // bs))
    # decode again from n with different tokens: a 3-token chunk, then single steps
    chunks = [new[:3]] + [[t] for t in new[3:]]
    got = _feed(runner, a, chunks)

    fresh_runner = new_runner(d, num_blocks=32, kv_block_size=bs)
    f = BlockTable()
    _feed(fresh_runner, f, _history_chunks(prompt, went, n))   # same steps, but never went past n
    want = _feed(fresh_runner, f, chunks)
    assert_fp32_close(got, want)
    # and both are what HF says for history[:n] + new
    ref = hf_logits(hf, history[:n] + new)[n:]
    assert_fp32_close(got, ref)

    with pytest.raises(ValueError):
        runner.allocator.truncate(a, a.num_tokens + 1)  # cannot "truncate" upwards


def test_truncate_rejects_a_negative_length():
    from flashpd.engine.kv_cache import BlockAllocator
    alloc, t = BlockAllocator(8, 4), BlockTable()
    alloc.ensure(t, 8)
    t.num_tokens = 8
    with pytest.raises(ValueError):
        alloc.truncate(t, -1)


def test_truncate_frees_blocks_that_another_sequence_reuses(make_checkpoint):
    hf, d = make_checkpoint(**CONFIGS["untied-gqa4to1-hd24-L4"])
    vocab, bs = hf.config.vocab_size, 4
    prompt, went, other, new = random_prompts([21, 20, 16, 8], vocab, seed=8)
    n = 26
    # exactly enough blocks for sequence A at its peak (41 positions = 11 blocks) + scratch:
    # after the truncate the only free blocks are the ones A gave back, so B must reuse them.
    runner = new_runner(d, num_blocks=1 + 11, kv_block_size=bs)
    a = BlockTable()
    _feed(runner, a, [prompt] + [[t] for t in went])
    assert runner.allocator.num_free == 0
    peak_blocks = list(a.blocks)
    runner.allocator.truncate(a, n)
    freed = set(peak_blocks[len(a.blocks):])
    assert a.blocks == peak_blocks[:7] and len(freed) == 4
    assert runner.allocator.num_free == 4

    b = BlockTable()
    runner.allocator.ensure(b, len(other))
    assert set(b.blocks) == freed                                # B lives in A's old blocks
    b_logits = runner.forward([b], [other], want_logits="all").logits[0]
    assert_fp32_close(b_logits, hf_logits(hf, other))

    # A continues (needs 2 more blocks: give them back to the pool by finishing B first)
    runner.allocator.free(b)
    got = _feed(runner, a, [[t] for t in new])
    ref_runner = new_runner(d, num_blocks=32, kv_block_size=bs)
    f = BlockTable()
    _feed(ref_runner, f, _history_chunks(prompt, went, n))
    want = _feed(ref_runner, f, [[t] for t in new])
    assert_fp32_close(got, want)
    assert_fp32_close(got, hf_logits(hf, (prompt + went)[:n] + new)[n:])


def test_interleaved_sequences_sharing_a_pool(make_checkpoint):
    """Two sequences decoded together after one of them rolled back, blocks recycled between them."""
    hf, d = make_checkpoint(**CONFIGS["tied-gqa4to1-h8-L4"])
    vocab, bs = hf.config.vocab_size, 4
    p1, p2, junk, c1, c2 = random_prompts([13, 30, 12, 10, 10], vocab, seed=9)
    runner = new_runner(d, num_blocks=40, kv_block_size=bs)
    a, b = BlockTable(), BlockTable()
    _feed(runner, a, [p1, junk])                      # A reads 13 + 12 junk positions
    runner.allocator.truncate(a, len(p1))             # ... and rolls the junk back
    _ensure(runner, [b], [len(p2)])
    runner.forward([b], [p2], want_logits="none")
    ga, gb = [], []
    for t1, t2 in zip(c1, c2):
        _ensure(runner, [a, b], [1, 1])
        out = runner.forward([a, b], [[t1], [t2]], want_logits="last")
        ga.append(out.logits[0, 0])
        gb.append(out.logits[1, 0])
    assert_fp32_close(torch.stack(ga), hf_logits(hf, p1 + c1)[len(p1):])
    assert_fp32_close(torch.stack(gb), hf_logits(hf, p2 + c2)[len(p2):])


# ---- taps -------------------------------------------------------------------------------------

@torch.no_grad()
def _hf_hidden_states(hf, tokens):
    ids = torch.tensor([tokens])
    return [h[0] for h in hf(input_ids=ids, output_hidden_states=True).hidden_states]


# (3, 0): the last layer's tap is, as HF's hidden_states[-1], taken after the final norm
@pytest.mark.parametrize("taps", [(2, 0, 1), (1,), (0, 2), (3, 0)])
def test_taps_equal_hf_hidden_states_in_requested_order(make_checkpoint, taps):
    hf, d = make_checkpoint(**CONFIGS["untied-gqa4to1-hd24-L4"])  # 4 layers
    prompts = random_prompts([1, 9, 40], hf.config.vocab_size, seed=10)
    runner = new_runner(d, num_blocks=32, taps=taps)
    tables = [BlockTable() for _ in prompts]
    _ensure(runner, tables, [len(p) for p in prompts])
    out = runner.forward(tables, prompts, want_logits="none", taps=True)
    assert out.logits is None
    assert len(out.taps) == len(taps)
    nxt = [7, 8, 9]
    _ensure(runner, tables, [1, 1, 1])
    step = runner.forward(tables, [[t] for t in nxt], want_logits="none", taps=True)
    for i, p in enumerate(prompts):
        hs = _hf_hidden_states(hf, p + [nxt[i]])
        for k, j in enumerate(taps):
            assert_fp32_close(out.taps[k][i, :len(p)], hs[j + 1][:len(p)],
                              msg=lambda m: f"tap {j} (slot {k}) row {i}: {m}")
            assert_fp32_close(step.taps[k][i, 0], hs[j + 1][len(p)])
    # taps=False gives none even when the runner has tap ids
    _ensure(runner, tables, [1, 1, 1])
    assert runner.forward(tables, [[1], [2], [3]], want_logits="none").taps == []


def test_prefill_features_concatenate_taps_in_requested_order(make_checkpoint):
    hf, d = make_checkpoint(**CONFIGS["untied-gqa4to1-hd24-L4"])
    taps = (2, 0)
    prompts = random_prompts([12, 3], hf.config.vocab_size, seed=12)
    gen = NativeGenerator(new_runner(d, num_blocks=32, taps=taps))
    seqs = gen.new_sequences(prompts, [SamplingParams(max_tokens=4)] * 2)
    feats = gen.prefill(seqs, taps=True)
    h = hf.config.hidden_size
    for s, p, f in zip(seqs, prompts, feats):
        hs = _hf_hidden_states(hf, p)
        assert f.shape == (len(p), len(taps) * h)
        assert_fp32_close(f, torch.cat([hs[j + 1] for j in taps], dim=-1))
        assert s.output == [hf_logits(hf, p)[-1].argmax().item()]


@pytest.mark.parametrize("bad", [(0, 0), (4,), (1, 5)])
def test_bad_tap_ids_are_rejected(make_checkpoint, bad):
    hf, d = make_checkpoint(**CONFIGS["untied-gqa4to1-hd24-L4"])
    runner = new_runner(d, num_blocks=8, taps=bad)
    t = BlockTable()
    _ensure(runner, [t], [3])
    with pytest.raises(ValueError, match="tap ids"):
        runner.forward([t], [[1, 2, 3]], taps=True)


def test_runner_refuses_unreserved_blocks_and_positions_past_the_end(make_checkpoint):
    hf, d = make_checkpoint(**CONFIGS["tied-gqa4to1-hd24-L2"])  # max_position_embeddings 1024
    runner = new_runner(d, num_blocks=80, kv_block_size=16)
    t = BlockTable()
    runner.allocator.ensure(t, 16)
    with pytest.raises(RuntimeError, match="allocator.ensure"):
        runner.forward([t], [list(range(17))])                  # one position more than reserved
    assert t.num_tokens == 0                                    # a refused forward advances nothing
    with pytest.raises(ValueError, match="at least one new token"):
        runner.forward([t], [[]])
    runner.allocator.ensure(t, 1025)
    with pytest.raises(ValueError, match="exceeds"):
        runner.forward([t], [[1] * 1025])
    # the last position the model has works, and matches HF
    (p,) = random_prompts([1024], hf.config.vocab_size, seed=13)
    out = runner.forward([t], [p], want_logits="last")
    assert_fp32_close(out.logits[0, 0], hf_logits(hf, p)[-1])
    assert t.num_tokens == 1024

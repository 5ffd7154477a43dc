"""The explicit-matmul attention (what a GPU runs for decode, verify and draft blocks) against the fused
SDPA kernel, and the engine's oracles re-run with it forced on the CPU: the target against HF, and
DFlash against the reference package's loop, token for token and step for step."""
from __future__ import annotations

import functools

import pytest
import torch

import flashpd.engine.attention as attention
from flashpd.engine.attention import grouped_sdpa, group_mask
from flashpd.engine.runner import ModelRunner, RunnerConfig

from conftest import new_runner
from tests._dflash_helpers import KV_BLOCK, Engine, dflash_engine, dflash_pair  # noqa: F401  (session fixtures)
import tests.test_dflash_parity as dflash_parity
import tests.test_target_parity as target_parity

MATMUL = RunnerConfig(cuda_graphs=False, attention_impl="matmul")  # reaches attention through AttnBatch.impl


@pytest.fixture
def force_matmul(monkeypatch):
    """The target oracle's runners (conftest.new_runner) built with the matmul form forced."""
    monkeypatch.setattr(target_parity, "new_runner", functools.partial(new_runner, config=MATMUL))


@pytest.mark.parametrize("b,t,hq,hkv,keys", [(1, 1, 4, 2, 256), (3, 16, 4, 2, 96), (2, 5, 8, 1, 64), (1, 7, 6, 6, 33)])
def test_matmul_form_equals_sdpa(b, t, hq, hkv, keys):
    g = torch.Generator().manual_seed(b * 100 + t)
    d = 24
    q = torch.randn(b, t, hq, d, generator=g)
    k = torch.randn(b, hkv, keys, d, generator=g)
    v = torch.randn(b, hkv, keys, d, generator=g)
    ends = torch.randint(1, keys + 1, (b, t), generator=g)  # every row sees at least key 0
    mask = (torch.arange(keys)[None, None, :] < ends[:, :, None]).unsqueeze(1)
    gm = group_mask(mask, hq // hkv)
    out = {}
    for impl in ("sdpa", "matmul"):
        out[impl] = grouped_sdpa(q, k, v, gm, d ** -0.5, impl)
    assert out["matmul"].shape == (b, t, hq * d)
    torch.testing.assert_close(out["matmul"], out["sdpa"], rtol=1e-5, atol=1e-5)


def test_the_choice_follows_the_score_size():
    q = torch.zeros(1, 16, 4, 8)
    assert not attention.use_matmul(q, 4096)  # never on a CPU unless forced
    assert attention.use_matmul(q, 4096, "matmul") and not attention.use_matmul(q, 1, "sdpa")
    if torch.cuda.is_available():  # pragma: no cover (GPU machines)
        assert attention.use_matmul(q.cuda(), 4096) and not attention.use_matmul(q.cuda(), 1 << 20)


@pytest.mark.parametrize("name", ["tied-gqa4to1-hd24-L2", "untied-gqa2to1-h6-hd12-L2"])
def test_target_matches_hf_with_matmul_attention(force_matmul, make_checkpoint, name):
    target_parity.test_prefill_and_decode_logits_match_hf(make_checkpoint, name, 16)


def test_dflash_matches_reference_with_matmul_attention(dflash_pair, dflash_engine):  # noqa: F811
    """The target and the drafter (DraftRunner passes runner.config.attention_impl on) both forced."""
    eng = dflash_engine
    runner = ModelRunner(eng.target, num_blocks=1024, kv_block_size=KV_BLOCK,
                         taps=tuple(eng.drafter.cfg.target_layer_ids), config=MATMUL)
    dflash_parity.test_generate_matches_reference_dflash_generate(dflash_pair, Engine(dflash_pair, eng.target,
                                                                                     eng.drafter, runner), 16)


@pytest.mark.parametrize("b,t,hq,hkv", [(5, 1, 8, 2), (4, 3, 6, 3), (2, 1, 4, 4)])
def test_paged_branch_projects_like_the_gather_branch(monkeypatch, b, t, hq, hkv):
    """The batched-decode branch of the layer (paged attention, then o_proj as one matmul over
    attention.heads_last's [B, T, Hq*d]) against the gather branch (attention.out_proj's per-KV-head
    matmuls and their sum), float32: the same layer output. The paged kernel is stood in for by the gather
    path's own attention (the kernel itself: test_paged_attention.py), so what is compared is the head
    order and the projection."""
    import flashpd.engine.qwen3 as qwen3  # noqa: PLC0415

    g = torch.Generator().manual_seed(b * 100 + t)
    d, hidden, inter, bs, nblk = 16, 32, 48, 4, 3
    keys = nblk * bs
    q = torch.randn(hkv, b, t * (hq // hkv), d, generator=g)
    k_cache, v_cache = torch.randn(2, b * nblk + 1, bs, hkv, d, generator=g).unbind(0)
    bt = torch.arange(1, b * nblk + 1).view(b, nblk)
    pos = torch.arange(keys - t, keys).repeat(b, 1)
    mask = group_mask(attention.causal_position_mask(pos, keys), hq // hkv)
    h = torch.randn(b, t, hidden, generator=g)
    w_o, w_post = torch.randn(hidden, hq * d, generator=g) / 8, torch.rand(hidden, generator=g) + 0.5
    w_gate_up, w_down = torch.randn(2 * inter, hidden, generator=g) / 6, torch.randn(hidden, inter, generator=g) / 7
    w_next = torch.rand(hidden, generator=g) + 0.5
    args = (h, q, k_cache, v_cache, bt, pos, mask, w_o, w_post, w_gate_up, w_down, w_next, 1e-6, d ** -0.5)
    gathered = qwen3.attn_mlp(*args)
    monkeypatch.setattr(qwen3, "use_paged", lambda *a: True)
    monkeypatch.setattr(qwen3, "paged_attention", lambda q_, kc, vc, bt_, pos_, scale, heads_last: attention.heads_last(
        attention.grouped_attention(q_, attention.gather_kv(kc, bt_), attention.gather_kv(vc, bt_), mask, scale), t))
    paged = qwen3.attn_mlp(*args)
    for p_, g_ in zip(paged, gathered, strict=True):  # the layer's output and it under the next norm
        torch.testing.assert_close(p_, g_, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,t,hq,hkv", [(1, 40, 8, 2), (2, 33, 6, 3), (1, 32, 8, 2), (3, 4, 4, 4)])
def test_out_proj_wide_rows_take_one_matmul(b, t, hq, hkv):
    """attention.out_proj: past OUT_PROJ_SUM_MAX_T tokens a row (a prefill chunk after a cached prefix) it is
    heads_last's copy and one matmul, bitwise; up to it, the per-KV-head matmuls and their sum. The two
    forms agree in float32 (the projection is the same; only the order of the head sum differs)."""
    g = torch.Generator().manual_seed(b * 1000 + t)
    d, hidden = 16, 24
    attn = torch.randn(hkv, b, t * (hq // hkv), d, generator=g)
    w_o = torch.randn(hidden, hq * d, generator=g) / 8
    one_matmul = torch.nn.functional.linear(attention.heads_last(attn, t), w_o)
    per_head = torch.bmm(attn.reshape(hkv, -1, hq * d // hkv),
                         w_o.view(hidden, hkv, -1).permute(1, 2, 0)).sum(0).view(b, t, hidden)
    out = attention.out_proj(attn, w_o)
    assert out.shape == (b, t, hidden)
    assert torch.equal(out, one_matmul if t > attention.OUT_PROJ_SUM_MAX_T else per_head)
    torch.testing.assert_close(one_matmul, per_head, rtol=1e-5, atol=1e-5)

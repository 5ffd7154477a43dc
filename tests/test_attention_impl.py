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


def _flash_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale, seqused_k):
    """Flash attention's variable-length forward as the docs define it, for one sequence on the CPU: queries
    cu_q[0]..cu_q[1], keys cu_k[0] .. cu_k[0] + seqused_k, causality aligned to the keys' end; rows past the
    sequence's queries are not written (NaN here, as uninitialised memory may be)."""
    assert causal and dropout == 0.0 and cu_q.dtype == cu_k.dtype == seqused_k.dtype == torch.int32
    assert len(cu_q) == len(cu_k) == 2 and int(cu_q[1]) <= max_q and int(cu_k[1]) <= max_k
    n_q, n_k = int(cu_q[1]), int(seqused_k[0])
    out = torch.full_like(q, float("nan"))
    groups = q.shape[1] // k.shape[1]
    kk = k[:n_k].repeat_interleave(groups, dim=1).transpose(0, 1)  # [Hq, n_k, d]
    vv = v[:n_k].repeat_interleave(groups, dim=1).transpose(0, 1)
    s = torch.einsum("qhd,hkd->hqk", q[:n_q], kk) * scale
    visible = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
    s = s.masked_fill(~visible, float("-inf"))
    out[:n_q] = torch.einsum("hqk,hkd->qhd", torch.softmax(s, -1), vv)
    return out, None, None, None, None


@pytest.mark.parametrize("prefix,real,t", [(37, 40, 40), (64, 33, 64), (5, 50, 64)])
def test_continued_sdpa_is_the_masked_attention_over_the_gathered_row(monkeypatch, prefix, real, t):
    """attention.continued_sdpa (one row after a cached prefix; flash's variable-length form on a GPU) against the
    gathered, masked `grouped_attention` in float32: the row's real queries agree, right-padding rows are zero.
    What runs here is the call's bookkeeping (the gather, the lengths, the alignment, the padding) around a
    plain-PyTorch statement of the flash op's documented contract; the op itself runs on the GPU only
    (its check there: the H200 diag in docs/results.md)."""
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _flash_varlen_reference)
    g = torch.Generator().manual_seed(prefix * 7 + real)
    hq, hkv, d, bs = 8, 2, 16, 8
    nblk = (prefix + t + bs - 1) // bs + 2  # room past the row, as a bucketed table has
    k_cache, v_cache = torch.randn(2, nblk + 3, bs, hkv, d, generator=g).unbind(0)
    bt = (torch.randperm(nblk + 2, generator=g)[:nblk] + 1)[None]
    pos = torch.zeros(1, t, dtype=torch.int64)
    pos[0, :real] = torch.arange(prefix, prefix + real)
    q = torch.randn(1, t, hq, d, generator=g)
    out = attention.continued_sdpa(q.view(t, hq, d), k_cache, v_cache, bt, pos, d ** -0.5)
    assert out.shape == (1, t, hq * d)
    mask = group_mask(attention.causal_position_mask(pos, nblk * bs), hq // hkv)
    ref = attention.heads_last(attention.grouped_attention(
        attention.group_queries(q, hkv), attention.gather_kv(k_cache, bt), attention.gather_kv(v_cache, bt), mask,
        d ** -0.5, "matmul"), t)
    torch.testing.assert_close(out[:, :real], ref[:, :real], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, real:], torch.zeros_like(out[:, real:]))


def test_continued_form_applies_to_one_half_precision_row_on_a_gpu_only():
    """attention.use_continued: one row past PAGED_MAX_T tokens in bf16/fp16 on a CUDA device of compute
    capability 8+, no forced form; everything else keeps the gathered, masked form."""
    cpu, t = torch.device("cpu"), attention.PAGED_MAX_T + 1
    assert not attention.use_continued(cpu, 1, t, torch.bfloat16, 128)
    if torch.cuda.is_available():  # pragma: no cover (GPU machines)
        cuda = torch.device("cuda")
        flash = torch.cuda.get_device_capability(cuda)[0] >= 8
        assert attention.use_continued(cuda, 1, t, torch.bfloat16, 128) == flash
        for args in ((2, t, torch.bfloat16, 128), (1, t - 1, torch.bfloat16, 128), (1, t, torch.float32, 128),
                     (1, t, torch.bfloat16, 100)):
            assert not attention.use_continued(cuda, *args)
        assert not attention.use_continued(cuda, 1, t, torch.bfloat16, 128, "matmul")

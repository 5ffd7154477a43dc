"""Drafter training through flex attention (float32, CPU): the BlockMask's visibility is exactly the
explicit mask's, and block_logits through flex gives the explicit-mask path's logits and gradients.

torch's flex attention runs forward only on CPU (its eager reference; no CPU backward), so the logits
are compared through real flex, and the gradients through the flex layer with its kernel replaced by a
differentiable dense attention that reads the same BlockMask (tiles and mask_mod): that checks every
step of the flex path besides torch's kernel. The block size is 16 and K*B, N exceed flex's 128-wide
tiles, so the masks span several query and key tiles (skipped, full and partial ones).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.loader import load_target
from flashpd.training import train_drafter as td
from flashpd.training.train_drafter import (DrafterTrainConfig, anchor_block_mask, attention_mode, block_logits,
                                            block_loss, drafter_config_for, init_from_target)

# the CPU forward of flex is its eager reference, which says so once
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B = 16
LENGTHS = (150, 97, 23)  # padded to 150


@pytest.fixture(scope="module")
def tiny_target(make_checkpoint):
    _, d = make_checkpoint(layers=4, kv_heads=2, head_dim=16, seed=21)
    return load_target(d)


@pytest.fixture(scope="module")
def drafter(tiny_target):
    tc = DrafterTrainConfig(layers=2, block_size=B, num_taps=2)
    m = dummy_drafter(drafter_config_for(tiny_target, tc), tiny_target, seed=3).float()
    init_from_target(m, tiny_target)
    with torch.no_grad():  # move off the warm start so that every weight matters
        g = torch.Generator().manual_seed(5)
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def _batch(k: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded sequences [3, 150], lengths, anchors [3, k]: 0, 1 and len-2, len-3 in each, the rest random."""
    g = torch.Generator().manual_seed(7)
    n = max(LENGTHS)
    seqs = torch.zeros(len(LENGTHS), n, dtype=torch.long)
    a = torch.empty(len(LENGTHS), k, dtype=torch.long)
    for s, length in enumerate(LENGTHS):
        seqs[s, :length] = torch.randint(0, 250, (length,), generator=g)
        a[s] = torch.cat([torch.tensor([0, 1, length - 2, length - 3]),
                          torch.randint(0, length - 1, (k - 4,), generator=g)])
    return seqs, torch.tensor(LENGTHS), a


def _explicit_mask(a: torch.Tensor, n: int, b: int) -> torch.Tensor:
    """[S, K*B, n + K*B] from the definition: context j < anchor of the query's block, own block's keys."""
    s_, k = a.shape
    q_anchor = a.repeat_interleave(b, dim=1)
    ctx = torch.arange(n)[None, None, :] < q_anchor[:, :, None]
    blk = torch.arange(k).repeat_interleave(b)
    return torch.cat([ctx, (blk[:, None] == blk[None, :]).expand(s_, -1, -1)], dim=2)


def _elementwise(bm) -> torch.Tensor:
    """What flex attends under a BlockMask, element by element: keys in the mask's tiles (listed
    partial tiles through mask_mod, full tiles whole), nothing in skipped tiles. [S, Q, KV]."""
    s_ = bm.kv_num_blocks.shape[0]
    q_len, kv_len = bm.seq_lengths
    bq, bk = bm.BLOCK_SIZE
    q, kv = torch.arange(q_len), torch.arange(kv_len)

    def tiles(num, idx):
        dense = torch.zeros(s_, num.shape[2], idx.shape[3], dtype=torch.bool)
        for s in range(s_):
            for r in range(num.shape[2]):
                dense[s, r, idx[s, 0, r, :num[s, 0, r]]] = True
        return dense.repeat_interleave(bq, 1).repeat_interleave(bk, 2)[:, :q_len, :kv_len]

    partial = tiles(bm.kv_num_blocks, bm.kv_indices)
    full = tiles(bm.full_kv_num_blocks, bm.full_kv_indices) if bm.full_kv_num_blocks is not None else \
        torch.zeros_like(partial)
    assert not (partial & full).any()
    mod = torch.stack([bm.mask_mod(torch.tensor(s), torch.tensor(0), q[:, None], kv[None, :]) for s in range(s_)])
    return full | (partial & mod)


@pytest.mark.parametrize("n,k,b,order", [(150, 20, 16, "random"), (600, 24, 16, "random"), (600, 24, 16, "sorted"),
                                         (517, 40, 7, "sorted"), (300, 9, 2, "random")])
def test_block_mask_is_the_explicit_mask(n, k, b, order):
    g = torch.Generator().manual_seed(n + k)
    a = torch.cat([torch.tensor([[0, 1, n - 2, n - 3], [2, 0, n - 3, n - 2]]),
                   torch.randint(0, n - 1, (2, k - 4), generator=g)], dim=1)
    if order == "sorted":  # block_logits' flex path sorts the anchors
        a = a.sort(dim=1).values
    bm = anchor_block_mask(a, n, b)
    assert bm.seq_lengths == (k * b, n + k * b) and bm.BLOCK_SIZE == (128, 128)
    assert torch.equal(_elementwise(bm), _explicit_mask(a, n, b))
    # the tiles classified from the anchors are the ones torch finds by evaluating the mask everywhere
    q_len, kv_len = k * b, n + k * b

    def inside(s, h, q, kv):  # create_block_mask also asks about the padding past q_len, kv_len
        return (q < q_len) & (kv < kv_len) & bm.mask_mod(s, h, q.clamp_max(q_len - 1), kv.clamp_max(kv_len - 1))

    ref = create_block_mask(inside, a.shape[0], None, q_len, kv_len, device="cpu")
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                  "q_indices", "full_q_num_blocks", "full_q_indices"):  # forward's and backward's views
        assert torch.equal(getattr(bm, field), getattr(ref, field)), field
    if order == "sorted" and n > 256:  # the point of the block mask: whole tiles skipped, or taken without a mask
        tiles = bm.kv_num_blocks.shape[2] * bm.kv_indices.shape[3]
        assert bm.full_kv_num_blocks.sum() > 0 and \
            (bm.kv_num_blocks + bm.full_kv_num_blocks).sum(dim=(1, 2)).max() < tiles


def test_flex_logits_equal_the_mask_path(tiny_target, drafter):
    seqs, _, a = _batch()
    with torch.no_grad():
        ref = block_logits(drafter, tiny_target, seqs, a, attention="mask")
        got = block_logits(drafter, tiny_target, seqs, a, attention="flex")  # real flex (eager, forward)
    assert got.shape == (3, a.shape[1], B - 1, tiny_target.cfg.vocab_size)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _dense_flex(q, k, v, block_mask, scale, enable_gqa):
    """Differentiable stand-in for flex: the same BlockMask read element by element, then dense SDPA."""
    mask = _elementwise(block_mask)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def test_flex_gradients_equal_the_mask_path(tiny_target, drafter, monkeypatch):
    seqs, lengths, _ = _batch()
    starts = torch.tensor([0, 5, 0])
    drafter.requires_grad_(True)
    try:
        grads = {}
        for mode in ("mask", "flex"):
            if mode == "flex":  # the kernel's stand-in, and the CPU guard (torch's missing backward) lifted
                monkeypatch.setattr(td, "flex_attention", _dense_flex)
                monkeypatch.setattr(td, "attention_mode", lambda mode, device, grad=True: mode)
            drafter.zero_grad(set_to_none=True)
            gen = torch.Generator().manual_seed(11)  # same anchors for both paths
            loss = block_loss(drafter, tiny_target, seqs, lengths, starts, 20, 7.0, gen, attention=mode)
            loss.backward()
            grads[mode] = (loss.detach(), {k: p.grad.clone() for k, p in drafter.named_parameters()})
    finally:
        drafter.requires_grad_(False)
        drafter.zero_grad(set_to_none=True)
    (l_mask, g_mask), (l_flex, g_flex) = grads["mask"], grads["flex"]
    torch.testing.assert_close(l_flex, l_mask, rtol=1e-6, atol=1e-6)
    assert g_mask.keys() == g_flex.keys() and all(g.abs().sum() > 0 for g in g_mask.values())
    for name in g_mask:
        torch.testing.assert_close(g_flex[name], g_mask[name], rtol=1e-4, atol=1e-6, msg=name)


def test_attention_modes_and_their_errors(tiny_target, drafter, tmp_path):
    assert attention_mode("auto", "cpu") == "mask" and attention_mode("auto", "cuda") == "flex"
    assert attention_mode("flex", "cuda") == "flex" and attention_mode("mask", "cuda") == "mask"
    assert attention_mode("flex", "cpu", grad=False) == "flex"
    with pytest.raises(ValueError, match="'sdpa' is not one of 'auto', 'mask', 'flex'"):
        attention_mode("sdpa", "cpu")
    with pytest.raises(ValueError, match="'flex' needs a CUDA device to train.*no CPU backward"):
        attention_mode("flex", "cpu")
    with pytest.raises(ValueError, match="no mps support"):
        attention_mode("flex", "mps", grad=False)
    seqs, _, a = _batch()
    drafter.requires_grad_(True)
    try:  # training (gradients wanted) through flex on CPU: refused before any work
        with pytest.raises(ValueError, match="needs a CUDA device"):
            block_logits(drafter, tiny_target, seqs, a, attention="flex")
    finally:
        drafter.requires_grad_(False)
    with pytest.raises(ValueError, match="is not one of"):
        block_logits(drafter, tiny_target, seqs, a, attention="dense")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        td.train_drafter(tiny_target, [[1, 2, 3]], [1], tmp_path / "d", DrafterTrainConfig(attention="flex"))
    assert not (tmp_path / "d").exists()

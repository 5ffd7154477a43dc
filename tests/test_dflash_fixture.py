"""Checks of the tiny DFlash target/drafter pair built by tests/dflash_fixtures.py.

They pin what other DFlash tests rely on: the checkpoint formats (dflash.md), that the
batched training forward equals the reference per-anchor call, that the reference
dflash_generate is exact against plain greedy on the pair, and that the trained drafter
accepts sometimes (acceptance lengths vary, tau clearly above 1).
"""
from __future__ import annotations

import json
import statistics

import pytest
import torch
from safetensors import safe_open

try:  # `python -m pytest` from the repo root puts the root on sys.path
    from tests import dflash_fixtures as fx
    from tests.dflash_fixtures import dflash_pair  # noqa: F401  (session fixture)
except ImportError:  # plain `pytest`: tests/ itself is on sys.path
    import dflash_fixtures as fx  # type: ignore[no-redef]
    from dflash_fixtures import dflash_pair  # type: ignore[no-redef]  # noqa: F401

MAX_NEW = 64


@pytest.fixture(scope="module")
def reference_runs(dflash_pair):
    """(output ids, acceptance lengths) of the reference for every held-out prompt."""
    return [fx.reference_generate(dflash_pair, p, MAX_NEW) for p in dflash_pair.prompts]


def test_reference_class_reads_the_config(dflash_pair):
    d = dflash_pair.ref_drafter
    assert d.target_layer_ids == fx.TARGET_LAYER_IDS
    assert d.mask_token_id == fx.MASK_TOKEN_ID
    assert d.block_size == dflash_pair.block_size == 16
    assert d.fc.in_features == len(fx.TARGET_LAYER_IDS) * fx.HIDDEN
    assert not d.training and not dflash_pair.hf_target.training
    assert d.dtype == torch.float32 and dflash_pair.hf_target.dtype == torch.float32


def test_drafter_checkpoint_format(dflash_pair):
    cfg = json.loads((dflash_pair.draft_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 16
    assert cfg["num_target_layers"] == fx.TARGET_LAYERS
    assert cfg["num_hidden_layers"] == 1
    assert cfg["dflash_config"] == {"mask_token_id": fx.MASK_TOKEN_ID,
                                    "target_layer_ids": fx.TARGET_LAYER_IDS}
    # transformers 5 writes rope as rope_parameters (the hub checkpoints have top-level rope_theta)
    assert cfg["rope_parameters"]["rope_theta"] == fx.ROPE_THETA
    h, inter, q, kv = fx.HIDDEN, fx.INTERMEDIATE, fx.NUM_HEADS * fx.HEAD_DIM, fx.NUM_KV_HEADS * fx.HEAD_DIM
    want = {
        "fc.weight": [h, len(fx.TARGET_LAYER_IDS) * h],
        "hidden_norm.weight": [h],
        "norm.weight": [h],
        "layers.0.self_attn.q_proj.weight": [q, h],
        "layers.0.self_attn.k_proj.weight": [kv, h],
        "layers.0.self_attn.v_proj.weight": [kv, h],
        "layers.0.self_attn.o_proj.weight": [h, q],
        "layers.0.self_attn.q_norm.weight": [fx.HEAD_DIM],
        "layers.0.self_attn.k_norm.weight": [fx.HEAD_DIM],
        "layers.0.mlp.gate_proj.weight": [inter, h],
        "layers.0.mlp.up_proj.weight": [inter, h],
        "layers.0.mlp.down_proj.weight": [h, inter],
        "layers.0.input_layernorm.weight": [h],
        "layers.0.post_attention_layernorm.weight": [h],
    }
    with safe_open(str(dflash_pair.draft_dir / "model.safetensors"), "pt") as f:
        got = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert got == want  # exactly these: no embed_tokens, no lm_head, no rotary buffers
    assert dtypes == {"F32"}


def test_target_checkpoint(dflash_pair):
    from transformers import Qwen3ForCausalLM

    cfg = json.loads((dflash_pair.target_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == fx.TARGET_LAYERS and cfg["vocab_size"] == fx.VOCAB_SIZE
    assert cfg["max_position_embeddings"] >= 2048 and cfg["tie_word_embeddings"] is False
    gen = json.loads((dflash_pair.target_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == fx.EOS_TOKEN_ID
    reloaded = Qwen3ForCausalLM.from_pretrained(dflash_pair.target_dir).float().eval()
    ids = torch.tensor([dflash_pair.prompts[3]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, dflash_pair.hf_target(ids).logits)


def test_batched_training_forward_matches_per_anchor_reference(dflash_pair):
    target, drafter = dflash_pair.hf_target, dflash_pair.ref_drafter
    g = torch.Generator().manual_seed(5)
    seqs = fx.greedy_continue(target, fx._random_prompts(g, 3, 20), 40)
    feats = fx.target_features(target, seqs)
    anchors = torch.tensor([[1, 5, 20], [3, 20, 40], [7, 8, 9]])
    with torch.no_grad():
        batched = fx._masked_block_forward(drafter, target, seqs, feats, anchors, 16, fx.MASK_TOKEN_ID)
        for i in range(3):
            for j in range(3):
                naive = fx._naive_block_forward(drafter, target, seqs[i], feats[i], int(anchors[i, j]), 16,
                                                fx.MASK_TOKEN_ID)
                torch.testing.assert_close(batched[i, j], naive, rtol=1e-5, atol=1e-5)


def test_heldout_prompts(dflash_pair):
    assert [len(p) for p in dflash_pair.prompts] == fx.HELDOUT_LENGTHS
    assert all(0 <= t < fx.VOCAB_SIZE - 2 for p in dflash_pair.prompts for t in p)
    assert min(dflash_pair.prompt_margins) >= fx.HELDOUT_MIN_MARGIN


def test_reference_is_exact_and_accepts_sometimes(dflash_pair, reference_runs):
    taus = []
    for prompt, (ids, acc) in zip(dflash_pair.prompts, reference_runs):
        assert ids == fx.plain_greedy(dflash_pair, prompt, MAX_NEW)
        assert fx.EOS_TOKEN_ID not in ids and fx.MASK_TOKEN_ID not in ids
        # the first token comes from the prefill; the last step is clipped to what fits
        assert sum(acc) == MAX_NEW - 1
        assert all(1 <= a <= 16 for a in acc)
        assert min(acc) == 1 and max(acc) >= 4, acc  # varies within every prompt
        taus.append(statistics.mean(acc))
    assert statistics.mean(taus) >= 2.0, taus
    assert min(taus) > 1.3, taus


def test_reference_with_smaller_block(dflash_pair):
    prompt = dflash_pair.prompts[4]
    ids, acc = fx.reference_generate(dflash_pair, prompt, MAX_NEW, block_size=8)
    assert ids == fx.plain_greedy(dflash_pair, prompt, MAX_NEW)
    assert max(acc) <= 8 and statistics.mean(acc) > 1.3


def test_saved_drafter_reloads_identically(dflash_pair, reference_runs):
    from dflash.model import DFlashDraftModel

    reloaded = DFlashDraftModel.from_pretrained(dflash_pair.draft_dir).float().eval()
    assert reloaded.target_layer_ids == fx.TARGET_LAYER_IDS
    twin = fx.Pair(target_dir=dflash_pair.target_dir, draft_dir=dflash_pair.draft_dir,
                   hf_target=dflash_pair.hf_target, ref_drafter=reloaded, prompts=dflash_pair.prompts,
                   block_size=dflash_pair.block_size)
    for i in (0, 5):
        assert fx.reference_generate(twin, dflash_pair.prompts[i], MAX_NEW) == reference_runs[i]


def test_build_is_deterministic(tmp_path):
    small = dict(train_steps=3, lengths=(5, 30), per_group=4, n_gen=16)
    a = fx.build_pair(tmp_path / "a", **small)
    b = fx.build_pair(tmp_path / "b", **small)
    assert a.prompts == b.prompts
    for (name, x), (_, y) in zip(list(a.hf_target.state_dict().items()) + list(a.ref_drafter.state_dict().items()),
                                 list(b.hf_target.state_dict().items()) + list(b.ref_drafter.state_dict().items())):
        assert torch.equal(x, y), name

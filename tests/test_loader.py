"""Checkpoint loading: single file vs shards, fused slices, clear errors, stop tokens, builtin configs, dummy weights."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import assert_fp32_close, build_hf_model, hf_logits, new_runner, random_prompts, save_checkpoint, save_sharded_checkpoint
from flashpd.engine.config import CheckpointError, Qwen3Config, builtin_config_path, load_config
from flashpd.engine.kv_cache import BlockTable
from flashpd.engine.loader import dummy_target, load_target
from flashpd.engine.runner import ModelRunner, RunnerConfig

SPEC = dict(tie=False, layers=2, heads=4, kv_heads=2, hidden=64, head_dim=24, intermediate=96)


def _edit_config(d: Path, **changes) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is _DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return cfg


_DELETE = object()


def _engine_logits(model_dir, tokens):
    runner = new_runner(model_dir, num_blocks=16)
    t = BlockTable()
    runner.allocator.ensure(t, len(tokens))
    return runner.forward([t], [tokens], want_logits="all").logits[0]


# ---- single file vs shards, and the fused slices ---------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
def test_sharded_checkpoint_matches_single_file_exactly(make_checkpoint, tie):
    hf, single = make_checkpoint(**{**SPEC, "tie": tie}, seed=3)
    _, sharded = make_checkpoint(**{**SPEC, "tie": tie}, seed=3, shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert not (sharded / "model.safetensors").exists()

    a, b = load_target(single), load_target(sharded)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert (b.lm_head is None) == tie
    tokens = random_prompts([19], 256, seed=2)[0]
    assert torch.equal(_engine_logits(single, tokens), _engine_logits(sharded, tokens))
    assert_fp32_close(_engine_logits(sharded, tokens), hf_logits(hf, tokens))


def test_fused_weights_are_filled_from_the_right_hf_tensors(make_checkpoint):
    hf, d = make_checkpoint(**SPEC, seed=4)
    model = load_target(d)
    ref = {k: v for k, v in hf.state_dict().items()}
    assert torch.equal(model.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])
    assert torch.equal(model.norm.weight, ref["model.norm.weight"])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = layer.self_attn
        assert torch.equal(a.qkv_proj.weight, torch.cat([ref[p + "self_attn.q_proj.weight"],
                                                         ref[p + "self_attn.k_proj.weight"],
                                                         ref[p + "self_attn.v_proj.weight"]]))
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([ref[p + "mlp.gate_proj.weight"],
                                                                     ref[p + "mlp.up_proj.weight"]]))
        assert torch.equal(a.o_proj.weight, ref[p + "self_attn.o_proj.weight"])
        assert torch.equal(a.q_norm.weight, ref[p + "self_attn.q_norm.weight"])
        assert torch.equal(a.k_norm.weight, ref[p + "self_attn.k_norm.weight"])
        assert torch.equal(layer.mlp.down_proj.weight, ref[p + "mlp.down_proj.weight"])
        assert torch.equal(layer.input_layernorm.weight, ref[p + "input_layernorm.weight"])
        assert torch.equal(layer.post_attention_layernorm.weight, ref[p + "post_attention_layernorm.weight"])
    assert model.cfg.rope_theta == 10_000.0 and model.cfg.head_dim == 24
    assert not any(p.requires_grad for p in model.parameters())


def test_tied_checkpoint_shares_the_embedding_and_ignores_an_exported_lm_head(make_checkpoint):
    hf, d = make_checkpoint(**{**SPEC, "tie": True}, seed=5, fresh=True)
    model = load_target(d)
    assert model.lm_head is None and model.head_weight is model.embed_tokens.weight
    # some exporters write lm_head.weight even when tied: a copy of the embedding is accepted
    sd = load_file(str(d / "model.safetensors"))
    assert "lm_head.weight" not in sd
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    tokens = random_prompts([11], 256, seed=3)[0]
    assert_fp32_close(_engine_logits(d, tokens), hf_logits(hf, tokens))


def test_bfloat16_checkpoint_loads_into_float32(tmp_path):
    hf = build_hf_model(**SPEC, seed=6)
    save_checkpoint(hf.to(torch.bfloat16), tmp_path)
    model = load_target(tmp_path, dtype=torch.float32)
    assert model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, hf.model.embed_tokens.weight.float())
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight.float())


def test_transformers_v4_style_config_loads(make_checkpoint):
    """Hub Qwen3 configs are v4-style: top-level rope_theta, rope_scaling null, torch_dtype."""
    hf, d = make_checkpoint(**SPEC, seed=7, fresh=True)
    cfg = _edit_config(d, rope_parameters=_DELETE, rope_theta=10_000.0, rope_scaling=None,
                       torch_dtype="float32", dtype=_DELETE, layer_types=_DELETE)
    assert "rope_parameters" not in cfg
    assert load_config(d).rope_theta == 10_000.0
    tokens = random_prompts([23], 256, seed=4)[0]
    assert_fp32_close(_engine_logits(d, tokens), hf_logits(hf, tokens))


def test_safetensors_without_the_standard_name_are_found(make_checkpoint):
    hf, d = make_checkpoint(**SPEC, seed=8, fresh=True)
    (d / "model.safetensors").rename(d / "weights-a.safetensors")
    tokens = random_prompts([9], 256, seed=5)[0]
    assert_fp32_close(_engine_logits(d, tokens), hf_logits(hf, tokens))


# ---- clear errors -----------------------------------------------------------------------------

def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_target(tmp_path / "does-not-exist")


def test_missing_config_json(make_checkpoint):
    _, d = make_checkpoint(**SPEC, seed=9, fresh=True)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json") as e:
        load_target(d)
    assert str(d) in str(e.value)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_config(d)


def test_no_safetensors_file(make_checkpoint, tmp_path):
    _, d = make_checkpoint(**SPEC, seed=9)
    shutil.copy(d / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not used")
    with pytest.raises(CheckpointError, match="no model.safetensors") as e:
        load_target(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_sharded_checkpoint_with_a_missing_shard(tmp_path):
    shards = save_sharded_checkpoint(build_hf_model(**SPEC, seed=10), tmp_path, "40KB")
    shards[1].unlink()
    with pytest.raises(CheckpointError, match="missing") as e:
        load_target(tmp_path)
    assert shards[1].name in str(e.value)


@pytest.mark.parametrize("archs,model_type,named", [
    (["LlamaForCausalLM"], "llama", "LlamaForCausalLM"),
    (["DFlashDraftModel"], "qwen3", "DFlashDraftModel"),
    (["Qwen2ForCausalLM"], "qwen2", "Qwen2ForCausalLM"),
])
def test_unsupported_architecture(make_checkpoint, archs, model_type, named):
    _, d = make_checkpoint(**SPEC, seed=11, fresh=True)
    _edit_config(d, architectures=archs, model_type=model_type)
    for load in (load_target, load_config):
        with pytest.raises(CheckpointError, match="unsupported architecture") as e:
            load(d)
        assert named in str(e.value)
        assert "Qwen3ForCausalLM" in str(e.value)  # says what is supported


def test_dflash_drafter_error_points_to_draft(make_checkpoint):
    _, d = make_checkpoint(**SPEC, seed=11, fresh=True)
    _edit_config(d, architectures=["DFlashDraftModel"])
    with pytest.raises(CheckpointError, match="--draft"):
        load_target(d)


@pytest.mark.parametrize("changes,match", [
    ({"architectures": _DELETE, "model_type": "llama"}, "unsupported model_type 'llama'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"rope_parameters": _DELETE, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling 'linear'"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_size": _DELETE}, r"missing required fields \['hidden_size'\]"),
    # fields that change the arithmetic, refused rather than loaded as if absent
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"rope_scaling": [{"rope_type": "yarn", "factor": 4.0}]}, "rope_scaling must be a JSON object"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be a JSON object"),
    ({"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "rope scaling 'yarn'"),
    ({"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_theta values disagree"),
])
def test_config_errors(make_checkpoint, changes, match):
    _, d = make_checkpoint(**SPEC, seed=12, fresh=True)
    _edit_config(d, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_target(d)


def test_equal_rope_thetas_in_both_places_load(make_checkpoint):
    """A config of transformers 5 may repeat rope_theta at the top level: equal values are one theta."""
    _, d = make_checkpoint(**SPEC, seed=12, fresh=True)
    _edit_config(d, rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert load_config(d).rope_theta == 5e5


def test_a_config_json_that_is_a_directory_is_a_checkpoint_error(make_checkpoint, tmp_path):
    _, d = make_checkpoint(**SPEC, seed=12, fresh=True)
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_target(d)


def test_sliding_window_config_is_refused(make_checkpoint):
    _, d = make_checkpoint(**SPEC, seed=12, fresh=True)
    _edit_config(d, use_sliding_window=True, sliding_window=8, max_window_layers=0,
                 layer_types=["sliding_attention"] * 2)
    with pytest.raises(CheckpointError, match="sliding"):
        load_target(d)


_SHAPE_MSG = re.compile(r"tensor (\S+) has shape \[([\d, ]+)\], the config implies \[([\d, ]+)\]")


def _shape_error(d: Path) -> tuple[str, list[int], list[int]]:
    with pytest.raises(CheckpointError) as e:
        load_target(d)
    m = _SHAPE_MSG.search(str(e.value))
    assert m, f"not a shape-mismatch message: {e.value}"
    assert str(d) in str(e.value)
    return m.group(1), [int(x) for x in m.group(2).split(",")], [int(x) for x in m.group(3).split(",")]


def _checkpoint_shapes(d: Path) -> dict[str, list[int]]:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("field,value,dim", [
    ("hidden_size", 80, 64),          # every hidden-wide tensor
    ("intermediate_size", 128, 96),   # gate/up/down
    ("vocab_size", 300, 256),         # embedding, lm_head
    ("head_dim", 16, 24),             # q/k/v/o and the q/k norms
])
def test_shape_mismatch_names_the_tensor(make_checkpoint, field, value, dim):
    _, d = make_checkpoint(**SPEC, seed=13, fresh=True)
    shapes = _checkpoint_shapes(d)
    _edit_config(d, **{field: value})
    name, got, want = _shape_error(d)
    assert name in shapes
    assert got == shapes[name]                        # the file's real shape
    assert len(got) == len(want) and got != want
    diff = [(g, w) for g, w in zip(got, want) if g != w]
    assert diff, (got, want)
    for g, w in diff:                                 # only the edited dimension differs
        assert g % dim == 0 and w % value == 0 and g // dim == w // value, (name, got, want)


def test_shape_mismatch_in_kv_heads(make_checkpoint):
    _, d = make_checkpoint(**SPEC, seed=13, fresh=True)  # 4 heads over 2 kv heads
    _edit_config(d, num_key_value_heads=4)
    name, got, want = _shape_error(d)
    assert re.fullmatch(r"model\.layers\.\d+\.self_attn\.[kv]_proj\.weight", name)
    assert got == [2 * 24, 64] and want == [4 * 24, 64]


@pytest.mark.parametrize("drop", ["model.layers.1.self_attn.k_norm.weight", "model.norm.weight",
                                  "lm_head.weight", "model.layers.0.mlp.up_proj.weight"])
def test_missing_tensor_is_named(make_checkpoint, drop):
    _, d = make_checkpoint(**SPEC, seed=14, fresh=True)
    sd = load_file(str(d / "model.safetensors"))
    del sd[drop]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensors") as e:
        load_target(d)
    assert drop in str(e.value)


def test_unexpected_tensors_are_named(make_checkpoint):
    _, d = make_checkpoint(**{**SPEC, "layers": 3}, seed=15, fresh=True)
    _edit_config(d, num_hidden_layers=2, layer_types=["full_attention"] * 2)
    with pytest.raises(CheckpointError, match="does not use") as e:
        load_target(d)
    assert "model.layers.2." in str(e.value)


def test_ignored_rotary_buffer_is_accepted(make_checkpoint):
    hf, d = make_checkpoint(**SPEC, seed=16, fresh=True)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(12)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    tokens = random_prompts([5], 256, seed=6)[0]
    assert_fp32_close(_engine_logits(d, tokens), hf_logits(hf, tokens))


@pytest.mark.parametrize("keep", [0.5, 0.01, 0.999])
def test_truncated_safetensors_file(make_checkpoint, keep):
    _, d = make_checkpoint(**SPEC, seed=17, fresh=True)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError) as e:
        load_target(d)
    assert "model.safetensors" in str(e.value) and "unreadable" in str(e.value)


# ---- stop tokens: generation_config.json wins over config.json -----------------------------

@pytest.mark.parametrize("gen_eos,expected", [
    ([5, 7], (5, 7)),
    (9, (9,)),
    (None, (3,)),       # generation_config.json without eos_token_id: config.json's
    ("absent", (3,)),   # no generation_config.json at all
])
def test_generation_config_eos_wins(make_checkpoint, gen_eos, expected):
    _, d = make_checkpoint(**SPEC, seed=18, fresh=True)
    _edit_config(d, eos_token_id=3)
    g = d / "generation_config.json"
    if gen_eos == "absent":
        g.unlink()
    else:
        gen = json.loads(g.read_text())
        gen.pop("eos_token_id", None)
        if gen_eos is not None:
            gen["eos_token_id"] = gen_eos
        g.write_text(json.dumps(gen))
    assert load_config(d).eos_token_ids == expected
    assert load_target(d).cfg.eos_token_ids == expected


def test_config_eos_list_and_absent(make_checkpoint):
    _, d = make_checkpoint(**SPEC, seed=18, fresh=True)
    (d / "generation_config.json").unlink()
    _edit_config(d, eos_token_id=[4, 6])
    assert load_config(d).eos_token_ids == (4, 6)
    _edit_config(d, eos_token_id=None)
    assert load_config(d).eos_token_ids == ()


# ---- builtin configs and dummy weights --------------------------------------------------------

@pytest.mark.parametrize("name,layers,hidden,inter,heads,tie", [
    ("qwen3-4b", 36, 2560, 9728, 32, True),
    ("qwen3-8b", 36, 4096, 12288, 32, False),
    ("qwen3-32b", 64, 5120, 25600, 64, False),
])
def test_builtin_configs(name, layers, hidden, inter, heads, tie):
    c = load_config(builtin_config_path(name))
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads) == \
        (layers, hidden, inter, heads)
    assert c.tie_word_embeddings is tie
    assert c.vocab_size == 151936 and c.head_dim == 128 and c.num_key_value_heads == 8
    assert c.rope_theta == 1_000_000.0 and c.rms_norm_eps == 1e-6
    assert c.max_position_embeddings == 40960
    assert 151645 in c.eos_token_ids
    assert c.q_size == heads * 128 and c.kv_size == 8 * 128
    assert load_config(builtin_config_path(name.upper())) == c


def test_unknown_builtin_config():
    with pytest.raises(CheckpointError, match="qwen3-8b"):
        builtin_config_path("qwen3-7b")


TINY_DICT = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=160, hidden_size=48,
                 intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2)


def _dummy_logits(model, tokens):
    runner = ModelRunner(model, num_blocks=8, kv_block_size=16, config=RunnerConfig(cuda_graphs=False))
    t = BlockTable()
    runner.allocator.ensure(t, len(tokens))
    return runner.forward([t], [tokens], want_logits="all").logits[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_target_is_finite_and_deterministic(dtype):
    cfg = Qwen3Config.from_dict(TINY_DICT)
    assert cfg.head_dim == 16 and cfg.eos_token_ids == (2,)
    a, b, c = (dummy_target(cfg, "cpu", dtype, seed=s) for s in (0, 0, 1))
    tokens = list(range(3, 40))
    la = _dummy_logits(a, tokens)
    assert la.shape == (len(tokens), 160) and la.dtype == dtype
    assert torch.isfinite(la).all()
    assert torch.equal(la, _dummy_logits(b, tokens))            # same seed, same model
    assert not torch.equal(la, _dummy_logits(c, tokens))        # another seed, another model
    for name, p in a.named_parameters():
        assert p.dtype == dtype and torch.isfinite(p).all()
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert 0.01 < p.float().std().item() < 0.04, name
    assert torch.equal(a.state_dict()["layers.0.self_attn.qkv_proj.weight"],
                       b.state_dict()["layers.0.self_attn.qkv_proj.weight"])


def test_dummy_target_from_a_builtin_config_path_keeps_its_fields():
    """The 8B config drives dummy_target; here only shrunk (never build 8B in tests)."""
    big = load_config(builtin_config_path("qwen3-8b"))
    small = Qwen3Config.from_dict({**big.raw, "num_hidden_layers": 1, "hidden_size": 64,
                                   "intermediate_size": 96, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
                                   "max_position_embeddings": 128})
    m = dummy_target(small, "cpu", torch.float32, seed=3)
    assert m.lm_head is not None and m.cfg.rope_theta == 1e6 and m.cfg.eos_token_ids == big.eos_token_ids
    assert m.rotary is not None and m.rotary.max_positions == 128
    assert torch.isfinite(_dummy_logits(m, [1, 2, 3, 4])).all()


# ---- malformed files: one CheckpointError naming the file and the problem --------------------

def test_malformed_json_and_field_types_name_the_file(make_checkpoint):
    _, d = make_checkpoint(fresh=True, **SPEC)
    good = (d / "config.json").read_text()
    for text, said in (("{not json", "not valid JSON"), ("[1, 2]", "must hold a JSON object")):
        (d / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match=said) as e:
            load_target(d)
        assert str(d / "config.json") in str(e.value)
    (d / "config.json").write_text(good)
    _edit_config(d, hidden_size="64")
    with pytest.raises(CheckpointError, match=r"hidden_size must be a positive integer, got '64'"):
        load_target(d)
    (d / "config.json").write_text(good)
    (d / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="generation_config.json: not valid JSON"):
        load_target(d)
    (d / "generation_config.json").unlink()
    (d / "tokenizer.json").write_text('{"model": 5}')
    from flashpd.engine.tokenizer import TextTokenizer  # noqa: PLC0415

    with pytest.raises(CheckpointError, match="tokenizer.json: unreadable tokenizer.json"):
        TextTokenizer.from_dir(d)


def test_a_tensor_that_is_not_a_float_type_is_refused(make_checkpoint):
    """Copied into a float parameter an int32 tensor would load as garbage and generate silently."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    _, d = make_checkpoint(fresh=True, **SPEC)
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.norm.weight"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=f"tensor {name} has dtype I32") as e:
        load_target(d)
    assert str(path) in str(e.value)


def test_a_tensor_holding_nan_or_inf_is_refused(make_checkpoint):
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    for bad in (float("nan"), float("inf")):
        _, d = make_checkpoint(fresh=True, **SPEC)
        path = d / "model.safetensors"
        tensors = load_file(str(path))
        name = "model.layers.1.mlp.down_proj.weight"
        tensors[name][3, 5] = bad
        save_file(tensors, str(path))
        with pytest.raises(CheckpointError, match=f"tensor {name} holds NaN or inf"):
            load_target(d)

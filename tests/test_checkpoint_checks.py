"""Bad checkpoints are refused at load with a CheckpointError naming the file and the field, before the model is
allocated, and nothing malformed loads silently (a config field of the wrong type or sign, a duplicated tensor, a
tokenizer of another model, a drafter config that does not parse)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashpd.engine.config import CheckpointError
from flashpd.engine.drafter import DrafterMismatch, load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.tokenizer import TextTokenizer

DEMO = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"


@pytest.fixture
def pair(tmp_path: Path) -> Path:
    """A copy of the demo pair (target/, drafter/) to mutate."""
    shutil.copytree(DEMO / "target", tmp_path / "target")
    shutil.copytree(DEMO / "drafter", tmp_path / "drafter")
    return tmp_path


def _edit(path: Path, **changes) -> None:
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _no_allocation(monkeypatch) -> None:
    """Fail the test if a model is materialised (every loader allocates through Module.to_empty)."""
    def refuse(self, *a, **k):
        raise AssertionError("the model was allocated before the checkpoint was checked")
    monkeypatch.setattr(torch.nn.Module, "to_empty", refuse)


# ---- sizes that do not fit the checkpoint: refused from the headers, before any allocation --------------------

@pytest.mark.parametrize("which,field,value,tensor", [
    ("target", "vocab_size", 10**6, "model.embed_tokens.weight"),
    ("target", "intermediate_size", 10**6, "mlp."),
    ("drafter", "intermediate_size", 10**6, "mlp."),
])
def test_a_size_the_checkpoint_does_not_have_is_refused_before_allocating(pair, monkeypatch, which, field, value,
                                                                          tensor):
    _edit(pair / which / "config.json", **{field: value})
    target = load_target(pair / "target") if which == "drafter" else None
    _no_allocation(monkeypatch)
    with pytest.raises(CheckpointError, match="the config implies") as e:
        load_target(pair / "target") if target is None else load_drafter(pair / "drafter", target)
    assert str(pair / which) in str(e.value) and tensor in str(e.value) and str(value) in str(e.value)


@pytest.mark.parametrize("which,field,value", [
    ("target", "head_dim", 10**18),            # torch's storage size arithmetic overflowed building the meta model
    ("target", "intermediate_size", 10**19),   # past int64: torch.empty could not unpack the size
    ("target", "hidden_size", 10**30),
    ("target", "vocab_size", 10**10),
    ("target", "num_hidden_layers", 100000),   # a module a layer: a minute and gigabytes before the headers
    ("drafter", "head_dim", 10**18),
    ("drafter", "intermediate_size", 10**19),
    ("drafter", "num_hidden_layers", 50000),
])
def test_an_absurd_size_is_refused_by_name_before_the_model_is_built(pair, monkeypatch, which, field, value):
    _edit(pair / which / "config.json", **{field: value})
    target = load_target(pair / "target") if which == "drafter" else None
    monkeypatch.setattr("flashpd.engine.qwen3.Qwen3ForCausalLM.__init__",
                        lambda *a, **k: pytest.fail("the model was built before the config was checked"))
    with pytest.raises(CheckpointError, match=f"{field} {value} is over") as e:
        load_target(pair / "target") if target is None else load_drafter(pair / "drafter", target)
    assert str(pair / which) in str(e.value)


def test_sizes_that_each_pass_but_multiply_past_int64_are_refused_by_name(pair):
    _edit(pair / "target" / "config.json", num_attention_heads=1 << 20, num_key_value_heads=1 << 20,
          head_dim=1 << 20, hidden_size=1 << 20)
    with pytest.raises(CheckpointError, match="the config's sizes overflow") as e:
        load_target(pair / "target")
    assert str(pair / "target" / "config.json") in str(e.value)


def test_max_positions_keeps_its_own_reason():
    from flashpd.engine.config import Qwen3Config
    d = json.loads((DEMO / "target" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="builds RoPE tables"):
        Qwen3Config.from_dict({**d, "max_position_embeddings": (1 << 20) + 1})


def test_a_missing_tensor_is_refused_before_allocating(pair, monkeypatch):
    path = pair / "target" / "model.safetensors"
    sd = load_file(str(path))
    del sd["model.norm.weight"]
    save_file(sd, str(path))
    _no_allocation(monkeypatch)
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.norm.weight'\]"):
        load_target(pair / "target")


@pytest.mark.parametrize("indexed", [False, True])
def test_a_tensor_in_two_files_is_refused(pair, indexed):
    """Read in file order, the later copy silently won (whatever the index said)."""
    d = pair / "target"
    sd = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").rename(d / "a.safetensors")
    save_file({"model.norm.weight": sd["model.norm.weight"] * 2}, str(d / "b.safetensors"))
    if indexed:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            **{k: "a.safetensors" for k in sd}, "model.layers.0.input_layernorm.weight": "b.safetensors"}}))
    with pytest.raises(CheckpointError, match="model.norm.weight is in both a.safetensors and b.safetensors"):
        load_target(d)


# ---- config.json fields of the wrong type or sign ----------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("rms_norm_eps", "1e-6"),       # loaded, then every request failed (Tensor + str)
    ("rms_norm_eps", -1.0),         # loaded and generated garbage
    ("rope_theta", "abc"),          # a bare float() error naming neither file nor field
    ("rope_theta", 0),              # loaded and generated garbage
    ("tie_word_embeddings", "false"),
    ("max_position_embeddings", (1 << 20) + 1),  # RoPE tables of that many rows (2**31: an OOM kill)
    ("eos_token_id", 2.7),          # read as 2
    ("eos_token_id", 4096),         # a stop id the model can never produce: never stops
    ("eos_token_id", [0, -1]),
])
def test_target_config_field_of_the_wrong_type_or_value_is_refused(pair, field, value):
    (pair / "target" / "generation_config.json").unlink()
    _edit(pair / "target" / "config.json", **{field: value})
    with pytest.raises(CheckpointError, match=field) as e:
        load_target(pair / "target")
    assert str(pair / "target" / "config.json") in str(e.value)


def test_a_string_false_tie_does_not_silently_tie_an_untied_head(make_checkpoint):
    """bool("false") is True: the untied lm_head.weight was ignored and the embedding served as the head."""
    _, d = make_checkpoint(tie=False, fresh=True)
    _edit(d / "config.json", tie_word_embeddings="false")
    with pytest.raises(CheckpointError, match="tie_word_embeddings must be true or false, got 'false'"):
        load_target(d)


def test_generation_config_eos_error_names_that_file(pair):
    (pair / "target" / "generation_config.json").write_text(json.dumps({"eos_token_id": "abc"}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id"):
        load_target(pair / "target")


# ---- the drafter's config.json ---------------------------------------------------------------------------------

def _edit_drafter(pair: Path, top: dict | None = None, dflash: dict | None = None) -> None:
    path = pair / "drafter" / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(top or {})
    if dflash is not None:
        cfg["dflash_config"].update(dflash)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("top,dflash,field", [
    ({"dflash_config": [1]}, None, "dflash_config must be a JSON object"),
    ({"rms_norm_eps": "x"}, None, "rms_norm_eps must be a positive number"),
    ({"rope_theta": "x"}, None, "rope_theta must be a positive number"),
    ({"input_embedding_scale": "x"}, None, "input_embedding_scale must be a positive number"),
    ({"final_logit_softcapping": -30.0}, None, "final_logit_softcapping must be a positive number"),
    (None, {"target_layer_ids": []}, "target_layer_ids must be a non-empty list"),  # was: the default taps
    ({"architectures": "DFlashDraftModel"}, None, "architectures must be a list"),
])
def test_drafter_config_field_of_the_wrong_type_is_refused(pair, top, dflash, field):
    _edit_drafter(pair, top, dflash)
    target = load_target(pair / "target")
    with pytest.raises(CheckpointError, match=field) as e:
        load_drafter(pair / "drafter", target)
    assert str(pair / "drafter" / "config.json") in str(e.value)


def test_drafter_null_kv_heads_means_the_default_as_for_the_target(pair):
    """null used to reach the head arithmetic (TypeError); now it means num_attention_heads, as in the target's
    config, and this checkpoint's 2 KV heads then do not fit (named)."""
    _edit_drafter(pair, {"num_key_value_heads": None})
    with pytest.raises(CheckpointError, match=r"k_proj.weight has shape \[96, 192\], the config implies \[192, 192\]"):
        load_drafter(pair / "drafter", load_target(pair / "target"))


def test_a_null_in_dflash_config_is_unset_and_the_top_level_value_stands(pair):
    """dflash_config wins, but its null was taken as the value: block_size null raised a bare TypeError (int(None)),
    num_target_layers null said "missing field" with the top-level value there."""
    cfg = json.loads((pair / "drafter" / "config.json").read_text())
    target = load_target(pair / "target")
    want = load_drafter(pair / "drafter", target).cfg
    top = {"num_target_layers": want.num_target_layers, "block_size": want.block_size}
    _edit_drafter(pair, top, {"num_target_layers": None, "block_size": None})
    got = load_drafter(pair / "drafter", target).cfg
    assert (got.num_target_layers, got.block_size) == (want.num_target_layers, want.block_size)
    assert cfg["dflash_config"].get("block_size", cfg.get("block_size")) == want.block_size


def test_drafter_mismatch_names_the_drafter_config(pair):
    _edit_drafter(pair, {"num_target_layers": 12})
    with pytest.raises(DrafterMismatch, match="num_target_layers 12") as e:
        load_drafter(pair / "drafter", load_target(pair / "target"))
    assert str(pair / "drafter" / "config.json") in str(e.value)


# ---- the tokenizer against the vocabulary ------------------------------------------------------------------------

def test_a_tokenizer_with_ids_past_the_vocabulary_is_refused_at_load(pair):
    """Its ids past the embedding failed a text prompt deep in the forward (IndexError; on a GPU a device assert
    that takes the engine down)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    path = pair / "target" / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.add_tokens(["QQQZZZ"])  # id 4096 in a 4096-token vocabulary
    tok.save(str(path))
    with pytest.raises(CheckpointError, match="tokenizer has token id 4096, outside .*config.json: vocab_size 4096") \
            as e:
        TextTokenizer.from_dir(pair / "target")
    assert str(path) in str(e.value)
    from flashpd.llm import LLM  # noqa: PLC0415

    with pytest.raises(CheckpointError, match="tokenizer has token id 4096"):
        LLM(target=pair / "target", device="cpu", kv_cache_tokens=64)


def test_the_demo_pair_still_loads(pair):
    from flashpd.llm import LLM  # noqa: PLC0415

    llm = LLM(target=pair / "target", draft=pair / "drafter", device="cpu", kv_cache_tokens=256)
    assert llm.tokenizer is not None and llm.drafter is not None
    assert llm.generate([[5, 6, 7]])[0].token_ids


# ---- which weights a directory holds is never ambiguous, and a tied head in the file is the embedding ---------

def _shard(target: Path) -> None:
    """target's model.safetensors split into two shards with an index (the single file removed)."""
    sd = load_file(target / "model.safetensors")
    names = sorted(sd)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, keys in parts.items():
        save_file({k: sd[k] for k in keys}, target / f, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    (target / "model.safetensors").unlink()


def test_a_directory_with_both_shards_and_a_single_file_is_refused(pair):
    single = load_file(pair / "target" / "model.safetensors")
    _shard(pair / "target")
    assert torch.equal(load_target(pair / "target").embed_tokens.weight, single["model.embed_tokens.weight"])
    save_file({k: v + 1 for k, v in single.items()}, pair / "target" / "model.safetensors")  # another model
    with pytest.raises(CheckpointError, match="both model.safetensors and model.safetensors.index.json"):
        load_target(pair / "target")


def test_an_index_naming_only_the_single_file_is_not_ambiguous(pair):
    names = load_file(pair / "target" / "model.safetensors")
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in names}}
    (pair / "target" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(load_target(pair / "target").embed_tokens.weight, names["model.embed_tokens.weight"])


def test_a_save_into_a_sharded_directory_is_refused_and_writes_nothing(pair):
    from flashpd.engine.export import save_drafter, save_target
    target = load_target(pair / "target")
    drafter = load_drafter(pair / "drafter", target)
    _shard(pair / "target")
    before = sorted(p.name for p in (pair / "target").iterdir())
    config = (pair / "target" / "config.json").read_bytes()
    with pytest.raises(CheckpointError, match="holds a sharded checkpoint"):
        save_target(target, pair / "target")
    with pytest.raises(CheckpointError, match="holds a sharded checkpoint"):
        save_drafter(drafter, pair / "target")
    assert sorted(p.name for p in (pair / "target").iterdir()) == before
    assert (pair / "target" / "config.json").read_bytes() == config
    save_target(target, pair / "fresh")  # an empty (or new) directory takes it
    assert torch.equal(load_target(pair / "fresh").embed_tokens.weight, target.embed_tokens.weight)


def test_a_tied_configs_head_in_the_file_must_be_the_embedding(pair, monkeypatch):
    f = pair / "target" / "model.safetensors"
    sd = load_file(f)
    assert "lm_head.weight" not in sd and json.loads((pair / "target" / "config.json").read_text())[
        "tie_word_embeddings"] is True
    embed = sd["model.embed_tokens.weight"]
    save_file({**sd, "lm_head.weight": embed.clone()}, f, metadata={"format": "pt"})  # the copy some exporters write
    monkeypatch.setattr("flashpd.engine.loader.TIED_CHECK_ROWS", 7)  # several blocks of rows
    assert torch.equal(load_target(pair / "target").embed_tokens.weight, embed)
    other = embed.clone()
    other[-1, 0] += 1.0  # one value in the last block
    save_file({**sd, "lm_head.weight": other}, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_target(pair / "target")
    # the embedding stored in fp32 and the head as its bf16 copy: a copy, at any load dtype
    fine = embed.float() + 1e-4 * torch.randn(embed.shape, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(fine.bfloat16().float(), fine)  # not all values are bf16 ones
    save_file({**sd, "model.embed_tokens.weight": fine, "lm_head.weight": fine.bfloat16()}, f,
              metadata={"format": "pt"})
    for dtype in (torch.float32, torch.bfloat16):
        load_target(pair / "target", dtype=dtype)
    save_file({**sd, "lm_head.weight": embed[:, :3].contiguous()}, f, metadata={"format": "pt"})
    _no_allocation(monkeypatch)
    with pytest.raises(CheckpointError, match=r"lm_head.weight has shape \[\d+, 3\]"):
        load_target(pair / "target")


@pytest.mark.parametrize("which,name", [("target", "config.json"), ("target", "tokenizer.json"),
                                        ("drafter", "config.json"), ("target", "generation_config.json"),
                                        ("target", "tokenizer_config.json"), ("target", "chat_template.jinja")])
def test_a_broken_link_is_named_not_taken_for_a_missing_file(pair, which, name):
    """generation_config.json, tokenizer_config.json and chat_template.jinja are optional, and a dangling link of
    one was read as absent: a broken generation_config.json blob quietly took the stop tokens from config.json."""
    from flashpd.cluster.chat_template import ChatTemplate
    from flashpd.cluster.http_api import sampling_defaults
    target = load_target(pair / "target") if which == "drafter" else None
    p = pair / which / name
    p.unlink(missing_ok=True)
    p.symlink_to(pair / "gone" / "blob")
    if name == "chat_template.jinja":  # read where tokenizer_config.json holds no template
        tc = pair / "target" / "tokenizer_config.json"
        tc.write_text(json.dumps({k: v for k, v in json.loads(tc.read_text()).items() if k != "chat_template"}))
    with pytest.raises(CheckpointError, match="broken link"):
        if which == "drafter":
            load_drafter(pair / "drafter", target)
        elif name == "config.json":
            load_target(pair / "target")
        elif name == "tokenizer.json":
            TextTokenizer.from_dir(pair / "target")
        elif name == "generation_config.json":
            load_target(pair / "target")
        else:
            ChatTemplate.from_dir(pair / "target")
    if name == "generation_config.json":  # the HTTP API's sampling defaults read it too
        with pytest.raises(CheckpointError, match="broken link"):
            sampling_defaults(pair / "target")


def test_a_save_cut_short_leaves_no_temporary_file_and_the_old_weights(pair):
    from flashpd.engine.export import write_model_file
    f = pair / "target" / "model.safetensors"
    before = f.read_bytes()

    def interrupted(tmp: Path) -> None:
        tmp.write_bytes(b"half a file")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_model_file(f, interrupted)
    assert f.read_bytes() == before and not (pair / "target" / "model.safetensors.tmp").exists()

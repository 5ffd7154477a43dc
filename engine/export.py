"""Write flashpd models back as checkpoints others read: HF Qwen3 targets, z-lab DFlash drafters.

The loaders' name -> (fused parameter, row slice) maps are inverted, so whatever flashpd writes
loads in transformers / the reference dflash package and back here. Every model file flashpd writes
(weights, configs, tokenizers, trainer state) goes through `write_model_file`: written beside its
place, made world-readable (0644) and renamed in.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from flashpd.engine.config import CheckpointError
from flashpd.engine.drafter import DFlashDrafter, draft_slices
from flashpd.engine.loader import slices_state_dict, target_slices
from flashpd.engine.qwen3 import Qwen3ForCausalLM


# A model directory is read by other processes and often other accounts (a service user, Ray workers, a
# copy on another machine, the shipped demo pair), so its files are 0644 whatever the writer's umask.
MODEL_FILE_MODE = 0o644


def write_model_file(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Write `path` through `write(tmp)` on a temporary name beside it, give it mode 0644 and rename it into
    place: a reader never sees a half-written file, and the mode does not follow a private umask."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.chmod(tmp, MODEL_FILE_MODE)
        tmp.replace(path)
    finally:  # a write cut short (Ctrl-C, a full disk) leaves no .tmp behind
        tmp.unlink(missing_ok=True)
    return path


def write_model_json(path: str | Path, obj, indent: int | None = None) -> Path:
    """`obj` as JSON through `write_model_file`."""
    text = json.dumps(obj, indent=indent)
    return write_model_file(path, lambda tmp: tmp.write_text(text))


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _out_dir(out_dir: str | Path) -> Path:
    """The directory a save writes config.json and model.safetensors into, refused if it holds a sharded
    checkpoint: its index would still name the old shards beside the new file (the loader refuses that pair)."""
    out = Path(out_dir)
    if (out / "model.safetensors.index.json").exists():
        raise CheckpointError(f"{out}: holds a sharded checkpoint (model.safetensors.index.json); save into an "
                              f"empty directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _save(sd: dict[str, torch.Tensor], out: Path, dtype: torch.dtype | None,
          metadata: dict[str, str] | None = None) -> None:
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    meta = {**(metadata or {}), "format": "pt"}
    write_model_file(out / "model.safetensors", lambda tmp: save_file(sd, str(tmp), metadata=meta))


def hf_config_dict(model: Qwen3ForCausalLM, dtype: str = "float32") -> dict:
    c = model.cfg
    eos = list(c.eos_token_ids)
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
            "attention_bias": False, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "torch_dtype": dtype}


def save_target(model: Qwen3ForCausalLM, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    out = _out_dir(out_dir)
    sd = slices_state_dict(target_slices(model))
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    name = _dtype_name(next(iter(sd.values())).to(dtype) if dtype else next(iter(sd.values())))
    _save(sd, out, dtype)  # the weights before the config: a save cut short never pairs a new config with old weights
    write_model_json(out / "config.json", hf_config_dict(model, name), indent=2)
    return out


def drafter_config_dict(d: DFlashDrafter, vocab_size: int, dtype: str) -> dict:
    c = d.cfg
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "vocab_size": vocab_size, "attention_bias": False, "block_size": c.block_size,
            "num_target_layers": c.num_target_layers, "torch_dtype": dtype,
            "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)}}


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None,
                 metadata: dict[str, str] | None = None) -> Path:
    """z-lab format: config.json (block_size, num_target_layers, dflash_config) + model.safetensors.
    metadata: extra string entries of the safetensors header (training tags its checkpoints' saves)."""
    out = _out_dir(out_dir)
    sd = slices_state_dict(draft_slices(drafter))
    name = _dtype_name(next(iter(sd.values())).to(dtype) if dtype else next(iter(sd.values())))
    cfg = drafter_config_dict(drafter, drafter.target.cfg.vocab_size, name)
    _save(sd, out, dtype, metadata)  # the weights before the config (save_target's reason)
    write_model_json(out / "config.json", cfg, indent=2)
    return out

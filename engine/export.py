"""Write flashpd models back as checkpoints others read: HF Qwen3 targets, z-lab DFlash drafters.

The loaders' name -> (fused parameter, row slice) maps are inverted, so whatever flashpd writes
loads in transformers / the reference dflash package and back here.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashpd.engine.drafter import DFlashDrafter, draft_slices
from flashpd.engine.loader import slices_state_dict, target_slices
from flashpd.engine.qwen3 import Qwen3ForCausalLM


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _save(sd: dict[str, torch.Tensor], out: Path, dtype: torch.dtype | None) -> None:
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    tmp = out / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")  # a reader never sees a half-written file


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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = slices_state_dict(target_slices(model))
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    name = _dtype_name(next(iter(sd.values())).to(dtype) if dtype else next(iter(sd.values())))
    (out / "config.json").write_text(json.dumps(hf_config_dict(model, name), indent=2))
    _save(sd, out, dtype)
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


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """z-lab format: config.json (block_size, num_target_layers, dflash_config) + model.safetensors."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = slices_state_dict(draft_slices(drafter))
    name = _dtype_name(next(iter(sd.values())).to(dtype) if dtype else next(iter(sd.values())))
    cfg = drafter_config_dict(drafter, drafter.target.cfg.vocab_size, name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _save(sd, out, dtype)
    return out

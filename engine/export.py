"""Write a flashpd target back as a Hugging Face Qwen3 directory (un-fusing QKV and gate/up).

Used by the demo and by training: whatever flashpd writes loads in transformers and back here.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashpd.engine.qwen3 import Qwen3ForCausalLM


def target_state_dict(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    c = model.cfg
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_tokens.weight,
                                   "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:
        sd["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        a, m = layer.self_attn, layer.mlp
        q, k, v = a.qkv_proj.weight.split([c.q_size, c.kv_size, c.kv_size])
        gate, up = m.gate_up_proj.weight.split([c.intermediate_size, c.intermediate_size])
        sd.update({pre + "self_attn.q_proj.weight": q, pre + "self_attn.k_proj.weight": k,
                   pre + "self_attn.v_proj.weight": v, pre + "self_attn.o_proj.weight": a.o_proj.weight,
                   pre + "self_attn.q_norm.weight": a.q_norm.weight, pre + "self_attn.k_norm.weight": a.k_norm.weight,
                   pre + "mlp.gate_proj.weight": gate, pre + "mlp.up_proj.weight": up,
                   pre + "mlp.down_proj.weight": m.down_proj.weight,
                   pre + "input_layernorm.weight": layer.input_layernorm.weight,
                   pre + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


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


def save_target(model: Qwen3ForCausalLM, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config_dict(model, dtype), indent=2))
    save_file(target_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

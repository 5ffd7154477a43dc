"""Model files flashpd writes are world-readable (0644) whatever the writer's umask: a model directory is
read by other processes and accounts (a service user, Ray workers, a copy on another machine)."""
from __future__ import annotations

import os
import stat

import torch

from flashpd.engine.config import Qwen3Config
from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.export import save_target
from flashpd.engine.loader import dummy_target
from flashpd.training.train_drafter import DrafterTrainConfig, drafter_config_for, save_checkpoint

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "eos_token_id": 0}


def test_checkpoints_are_0644_under_a_private_umask(tmp_path):
    target = dummy_target(Qwen3Config.from_dict(TINY), "cpu", torch.float32)
    drafter = dummy_drafter(drafter_config_for(target, DrafterTrainConfig(layers=1, num_taps=2)), target).float()
    opt = torch.optim.AdamW(drafter.parameters())
    old = os.umask(0o077)  # what a private umask gives a plain open(): 0600
    try:
        save_target(target, tmp_path / "target")
        save_checkpoint(drafter, opt, 1, tmp_path / "drafter", DrafterTrainConfig(layers=1, num_taps=2), [1.0])
    finally:
        os.umask(old)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert {p.relative_to(tmp_path).as_posix() for p in files} == {
        "target/config.json", "target/model.safetensors", "drafter/config.json", "drafter/model.safetensors",
        "drafter/trainer_state.pt", "drafter/train_config.json"}  # no temporary file left behind
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: "0o644" for p in files}

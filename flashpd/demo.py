"""`flashpd demo`: generation on a small model built locally, with no arguments and no network.

Until the trained demo pair ships, this is a tiny RANDOM target (seeded, lm_head sharpened):
its text is meaningless token ids; the demo shows the engine end to end and its timings.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from flashpd.engine.config import Qwen3Config
from flashpd.engine.export import save_target
from flashpd.engine.loader import dummy_target
from flashpd.engine.sampling import SamplingParams

TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=128,
            intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False)


def demo_dir() -> Path:
    return Path(os.environ.get("FLASHPD_CACHE", Path.home() / ".cache" / "flashpd")) / "demo-tiny-random"


def ensure_tiny_model() -> Path:
    """Write the seeded tiny random target once (idempotent)."""
    out = demo_dir()
    if (out / "model.safetensors").exists():
        return out
    model = dummy_target(Qwen3Config.from_dict(TINY), "cpu", torch.float32, seed=1234)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharpen: random logits are otherwise near-ties
    tmp = out.with_suffix(".tmp")
    save_target(model, tmp)
    tmp.rename(out)
    return out


def run_demo(device: str | None = None) -> int:
    from flashpd.llm import LLM  # noqa: PLC0415

    path = ensure_tiny_model()
    print("flashpd demo: a tiny RANDOM Qwen3-architecture model (4 layers, 128 wide), built locally;")
    print("its outputs are meaningless token ids. The trained demo pair (target + DFlash drafter) replaces it.")
    llm = LLM(target=path, device=device)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 74)), [7] * 300]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    for p, o in zip(prompts, outs):
        print(f"prompt {len(p):4d} tokens -> {o.token_ids[:16]}... ({len(o.token_ids)} tokens, "
              f"ttft {o.stats.ttft_ms:.1f} ms)")
    n = sum(len(o.token_ids) for o in outs)
    print(f"native, batch {len(prompts)}, device {llm.device}: {n} tokens in {dt * 1e3:.0f} ms")
    return 0

"""Shared fixtures: tiny random Qwen3 checkpoints written by transformers (the oracle).

Every checkpoint is a real Hugging Face directory (config.json, generation_config.json,
model.safetensors or shards + model.safetensors.index.json) saved by
`Qwen3ForCausalLM.save_pretrained`, so the engine's loader reads exactly what it reads from
the hub. Models are float32 and tiny; the output head (the embedding when tied) is scaled by 8
before saving so that greedy choices are far from ties, and every RMSNorm weight is randomised
(HF initialises them to ones, which would hide a loader that mixes up norm tensors).

A random tiny model at HF's init collapses into repeating one token under greedy decoding
(the residual stream is dominated by the current token's embedding), which would make
"same greedy tokens as HF" a weak check. So attention is made to matter: q_norm/k_norm
weights ~2 (sharper attention), v_proj/o_proj x4 (larger attention output) and a final norm
weight with random signs (breaks the tied embedding's self-similarity). The greedy streams
then hold 30-50 distinct tokens in 64.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from transformers import Qwen3Config as HFQwen3Config
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner, RunnerConfig

# One intra-op thread: the models are tiny (every matmul is a few microseconds), and with two
# threads each op pays an OpenMP barrier; when the 2 cores are shared with anything else the
# barriers stall and the suite runs ~10x slower (measured: 70 s vs 6 s for the same tests).
torch.set_num_threads(1)

# The longest files, started first. Under the README's `-n 3 --dist loadfile` xdist hands whole files to its workers
# in collection order, so a long file collected late (most of these sort late) ran on with the other workers idle.
# Only the order changes: every test runs, each file's tests in their own order.
SLOW_FIRST = ("test_cluster_ray.py", "test_paged_attention.py", "test_device_loop.py", "test_qkv_rope.py",
              "test_training.py", "test_warmup.py", "test_job_sweep.py", "test_bench_speedup.py",
              "test_skinny_gemm.py", "test_api_hardening.py", "test_sampling.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order

# Defaults of the tiny checkpoints (each test overrides what it needs).
TINY = dict(vocab=256, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=1, head_dim=24,
            tie=False, rope_theta=10_000.0, max_pos=1024, eos=None, seed=0)


def hf_config(*, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
              head_dim: int | None, tie: bool, rope_theta: float, max_pos: int, eos: Any,
              **_: Any) -> HFQwen3Config:
    return HFQwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim if head_dim is not None else hidden // heads,
        tie_word_embeddings=tie, max_position_embeddings=max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=None, pad_token_id=None,
    )


def build_hf_model(**overrides: Any) -> HFQwen3ForCausalLM:
    """A random float32 HF Qwen3 in eval mode (head x8, random norm weights), seeded."""
    spec = {**TINY, **overrides}
    unknown = set(spec) - set(TINY)
    assert not unknown, f"unknown checkpoint options {unknown}"
    torch.manual_seed(spec["seed"])
    model = HFQwen3ForCausalLM(hf_config(**spec)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(2.0 * (1.0 + 0.2 * torch.randn_like(p)))
            elif name == "model.norm.weight":
                p.copy_(torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(("v_proj.weight", "o_proj.weight")):
                p.mul_(4.0)
        # lm_head, or (tied) the embedding it shares, scaled in place: greedy far from ties.
        model.get_output_embeddings().weight.mul_(8.0)
    if spec["tie"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def save_checkpoint(model: HFQwen3ForCausalLM, directory: Path, max_shard_size: str | int | None = None) -> Path:
    """save_pretrained into `directory`; a small max_shard_size writes several shards + index."""
    directory = Path(directory)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(directory), **kwargs)
    assert (directory / "config.json").exists()
    return directory


def save_sharded_checkpoint(model: HFQwen3ForCausalLM, directory: Path, max_shard_size: str | int = "40KB") -> list[Path]:
    """Write `model` as several safetensors shards plus model.safetensors.index.json; returns the shards."""
    save_checkpoint(model, directory, max_shard_size=max_shard_size)
    index = json.loads((Path(directory) / "model.safetensors.index.json").read_text())
    shards = sorted({Path(directory) / f for f in index["weight_map"].values()})
    assert len(shards) >= 2, f"max_shard_size={max_shard_size} produced {len(shards)} shard(s)"
    assert not (Path(directory) / "model.safetensors").exists()
    return shards


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[HFQwen3ForCausalLM, Path]]:
    """Factory: make_checkpoint(**overrides, shard_size=None, fresh=False) -> (hf_model, directory).

    Identical requests share one directory unless fresh=True (tests that edit the files ask
    for a fresh one).
    """
    cache: dict[tuple, tuple[HFQwen3ForCausalLM, Path]] = {}

    def make(shard_size: str | int | None = None, fresh: bool = False, **overrides: Any):
        key = (shard_size, tuple(sorted(overrides.items())))
        if not fresh and key in cache:
            return cache[key]
        model = build_hf_model(**overrides)
        d = tmp_path_factory.mktemp("qwen3")
        if shard_size is None:
            save_checkpoint(model, d)
        else:
            save_sharded_checkpoint(model, d, shard_size)
        if not fresh:
            cache[key] = (model, d)
        return model, d

    return make


def new_runner(model_dir: Path | str, num_blocks: int = 256, kv_block_size: int = 16,
               taps: tuple[int, ...] = (), config: RunnerConfig | None = None) -> ModelRunner:
    """A CPU float32 runner over a freshly loaded target (default config: no CUDA graphs)."""
    return ModelRunner(load_target(model_dir), num_blocks=num_blocks, kv_block_size=kv_block_size, taps=taps,
                       config=config or RunnerConfig(cuda_graphs=False))



# ---- float32 comparisons against an oracle ------------------------------------------------------------
# Two correct float32 computations of the same network differ only by rounding: the engine and the
# oracle sum the same products in other orders (fused projections, paged attention, batched rows), and
# each reordered reduction of n terms moves the result by a few ulp of its largest term. Errors are
# therefore bounded RELATIVE to the magnitude of the values compared, never by a fixed atol: a fixed
# 1e-5 is 84 ulp of a value of 1 but 4 ulp of a value of 20, so it passes or fails with the model's
# scale and with the BLAS build (a tap after the final norm failed it by 1.23e-5 under another
# transformers/torch pair). The bound: FP32_ULPS ulp of the largest |value| in the reference. Over the
# 1,162 comparisons of test_target_parity, test_loader, test_dflash_parity and test_training the worst
# was 32.4 ulp (a decode after a truncate over 40 single-token steps), most under 10; 128 leaves a
# factor of 4, while an indexing or masking bug moves values by O(1), about 1e6 ulp.
FP32_ULPS = 128


def fp32_atol(want: torch.Tensor, ulps: float = FP32_ULPS) -> float:
    """The absolute tolerance that FP32_ULPS ulp of want's largest magnitude gives (see above)."""
    return ulps * torch.finfo(torch.float32).eps * max(float(want.abs().max()), torch.finfo(torch.float32).tiny)


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor, ulps: float = FP32_ULPS, msg=None) -> None:
    """got equals want up to float32 rounding (fp32_atol), elementwise."""
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=fp32_atol(want.float(), ulps), msg=msg)


def random_prompts(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_logits(model: HFQwen3ForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Full-sequence HF logits [T, V] for one unpadded sequence."""
    ids = torch.tensor([tokens])
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()


@torch.no_grad()
def hf_greedy(model: HFQwen3ForCausalLM, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from HF generate(do_sample=False), no stop token (the config has none)."""
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                         num_beams=1)
    new = out[0, len(prompt):].tolist()
    assert len(new) == n, f"HF generate returned {len(new)} tokens, wanted {n}"
    return new

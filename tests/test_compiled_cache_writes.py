"""The runner's inductor-compiled `attn_inputs` writes a layer's K and V into the cache it is given as two views of one
tensor, and nothing else.

Why: a compiled function that mutates two graph inputs aliasing one storage (the layer's K and V views, V at an
offset) goes through functionalization. For a mutable custom op inductor (torch 2.11) then clones "the base" from
the view's own pointer and reads past the cache (tests/test_qkv_rope.py's compiled case; pytorch/pytorch#139628).
The engine's compiled `attn_inputs` writes its K/V with aten ops, and this checks that path through real inductor
code generation (the CPU's C++ backend): the slots written hold the eager values, every other slot and every other
layer keeps its bits.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from flashpd.engine.config import Qwen3Config
from flashpd.engine.layers import Rotary
from flashpd.engine.loader import dummy_target
from flashpd.engine.qwen3 import EAGER
from flashpd.engine.runner import ModelRunner, RunnerConfig

N_Q, N_KV, D, H = 8, 2, 32, 64


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_attn_inputs_writes_only_its_slots_of_aliased_cache_views() -> None:
    cfg = Qwen3Config(vocab_size=64, hidden_size=H, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=N_Q, num_key_value_heads=N_KV, head_dim=D)
    torch._dynamo.reset()
    runner = ModelRunner(dummy_target(cfg, "cpu", torch.float32), 6, 8,
                         config=RunnerConfig(cuda_graphs=False, compile=True, compile_backend="inductor"))
    g = torch.Generator().manual_seed(0)
    b, t = 2, 3
    x = torch.randn(b, t, H, generator=g)
    w = torch.randn((N_Q + 2 * N_KV) * D, H, generator=g) / 8
    wq, wk = 1 + torch.randn(D, generator=g) / 4, 1 + torch.randn(D, generator=g) / 4
    cos, sin = Rotary(D, 1e6, 512, "cpu").tables(torch.randint(0, 512, (b, t), generator=g), torch.float32)
    data = torch.randn(3, 2, 6, 8, N_KV, D, generator=g)  # [layers, K/V, blocks, block size, heads, d]
    slots = torch.randperm(48, generator=g)[:b * t]
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots] = False

    def run(fn, layer: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        cache = data.clone()
        out = fn(x, cos, sin, w, wq, wk, 1e-6, N_Q, N_KV, D, cache[layer, 0].view(-1, N_KV, D),
                 cache[layer, 1].view(-1, N_KV, D), slots)
        return out, cache

    for layer in (0, 1, 2):  # K/V at offsets 0 and past it, in the middle, at the storage's end
        (q, k, v), got = run(runner.graph_fns.attn_inputs, layer)
        (q0, k0, v0), want = run(EAGER.attn_inputs, layer)
        torch.testing.assert_close(q, q0, rtol=1e-5, atol=1e-5)
        for kv in (0, 1):
            flat, orig = got[layer, kv].view(-1, N_KV, D), data[layer, kv].view(-1, N_KV, D)
            assert torch.equal(flat[untouched], orig[untouched]), (layer, kv)
            torch.testing.assert_close(flat[slots], want[layer, kv].view(-1, N_KV, D)[slots], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[layer, 1].view(-1, N_KV, D)[slots], v0)  # values are copied, not computed
        others = [i for i in range(3) if i != layer]
        assert torch.equal(got[others], data[others]), layer
    torch._dynamo.reset()

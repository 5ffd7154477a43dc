"""A one-token decode's q/k norms, RoPE and cache write inside the paged attention kernel
(paged_attention.paged_attention_rope) against the two kernels it replaces, qkv_rope_write then paged_attention:
the same output and the same cache, bitwise, walking and a program per chunk, at positions on and off chunk
edges; and the engine's decode taking it with the same tokens as with it off.

Without a GPU the kernels run under triton's interpreter in one child process (tests/_interpreted.py says why);
on a GPU the cases run here on CUDA tensors, where the bits come from the compiled kernels."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable

import pytest
import torch
from _interpreted import check as check_case

import flashpd.engine.paged_attention as engine_pa
from flashpd.engine.layers import Rotary

CASES: dict[str, Callable[[ModuleType, str], None]] = {}
KERNELS = engine_pa  # the module the cases take (tests/_interpreted.py)
EPS = 1e-6


def operands(dev: str, dtype: torch.dtype, n_q: int, n_kv: int, d: int, page: int, ends: list[int],
             nblk: int, seed: int) -> dict:
    """QKV rows of a one-token decode for rows whose contexts end at `ends` (the token at position end - 1),
    RoPE tables there, norm weights, a cache of random values with distinct blocks per row (the tables' tails
    padded with the scratch block 0), and each row's slot, as the runner makes them."""
    g = torch.Generator().manual_seed(seed)
    b = len(ends)
    blocks = 1 + b * nblk
    pos = torch.tensor(ends).view(b, 1) - 1
    tables = torch.zeros(b, nblk, dtype=torch.int64)
    perm = torch.randperm(blocks - 1, generator=g) + 1
    for i, e in enumerate(ends):
        used = -(-e // page)
        tables[i, :used] = perm[i * nblk:i * nblk + used]
    slots = tables.gather(1, pos // page).view(-1) * page + pos.view(-1) % page
    rot = Rotary(d, 1e6, 4096, "cpu")
    cos, sin = rot.tables(pos, dtype)
    return {"qkv": (torch.randn(b, 1, (n_q + 2 * n_kv) * d, generator=g) * 3).to(dev, dtype),
            "cos": cos.to(dev), "sin": sin.to(dev),
            "w_qn": (1 + torch.randn(d, generator=g) / 4).to(dev, dtype),
            "w_kn": (1 + torch.randn(d, generator=g) / 4).to(dev, dtype),
            "cache": torch.randn(2, blocks, page, n_kv, d, generator=g).to(dev, dtype),
            "tables": tables.to(dev), "pos": pos.to(dev), "slots": slots.to(dev), "n_q": n_q, "n_kv": n_kv, "d": d}


def two_kernels(pa: ModuleType, o: dict, split: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv_rope's kernel, then the paged kernel in o_proj's layout (the engine's path without FUSED_ROPE)."""
    from flashpd.engine.qkv_rope import qkv_rope_write
    cache, n_kv, d = o["cache"].clone(), o["n_kv"], o["d"]
    q = qkv_rope_write(o["qkv"], o["cos"], o["sin"], o["w_qn"], o["w_kn"], EPS, o["n_q"], n_kv,
                       cache[0].view(-1, n_kv, d), cache[1].view(-1, n_kv, d), o["slots"])
    out = pa.paged_attention(q, cache[0], cache[1], o["tables"], o["pos"], d ** -0.5, heads_last=True, split=split)
    return out, cache


def one_kernel(pa: ModuleType, o: dict, split: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    cache = o["cache"].clone()
    out = pa.paged_attention_rope(o["qkv"], o["cos"], o["sin"], o["w_qn"], o["w_kn"], EPS, o["n_q"], cache[0],
                                  cache[1], o["slots"], o["tables"], o["pos"], o["d"] ** -0.5, split=split)
    return out, cache


def equals_the_two_kernels(pa: ModuleType, dev: str, dtype: torch.dtype, shape: tuple[int, int, int, int],
                           ends: list[int], nblk: int) -> None:
    """Output and whole cache bitwise the two kernels', walking (split False), a program per key chunk (True) and
    as the shape decides (None); the rows end on chunk edges and off them (KEYS_PER_CHUNK = 32), at key 1 and
    past several chunks. Only each row's slot changed in the cache."""
    n_q, n_kv, d, page = shape
    o = operands(dev, dtype, n_q, n_kv, d, page, ends, nblk, seed=sum(ends))
    for split in (False, True, None):
        ref, ref_cache = two_kernels(pa, o, split)
        out, cache = one_kernel(pa, o, split)
        assert out.shape == (len(ends), 1, n_q * d) and out.dtype == dtype
        assert torch.equal(out, ref), (split, (out.float() - ref.float()).abs().max().item())
        assert torch.equal(cache, ref_cache), split
        changed = (cache != o["cache"]).flatten(3).any(-1).any(0).view(-1).nonzero().view(-1)  # slots changed
        assert set(changed.tolist()) <= set(o["slots"].tolist()), split
        # a row attends to its own token's key and value from the program's registers, not from its slot: written
        # to the scratch block instead (as the device loop's frozen rows write), the output is the same
        out_scratch, _ = one_kernel(pa, {**o, "slots": torch.zeros_like(o["slots"])}, split)
        assert torch.equal(out_scratch, ref), split


_ENDS = [1, 32, 33, 64, 95, 140]
for _dt in (torch.float32, torch.bfloat16):
    CASES[f"two-kernels-{str(_dt)[6:]}"] = (
        lambda pa, dev, dt=_dt: equals_the_two_kernels(pa, dev, dt, (8, 2, 32, 8), _ENDS, 20))
# the Qwen3-8B head shape (32 query heads, 8 KV heads, d 128) and the engine's block of 16 keys
CASES["two-kernels-qwen3-8b-heads"] = (
    lambda pa, dev: equals_the_two_kernels(pa, dev, torch.bfloat16, (32, 8, 128, 16), [7, 64, 300], 20))


def the_engine_decode_takes_it(pa: ModuleType, dev: str) -> None:
    """A native and a DFlash generation on the paged path, with FUSED_ROPE on and off: the same tokens (and
    DFlash's acceptance lengths); the native decode's one-token steps go through paged_attention_rope (a spy
    counts the calls; a DFlash step is a verify, which keeps the two kernels)."""
    from flashpd.engine.generate import NativeGenerator
    from flashpd.engine.runner import ModelRunner
    from flashpd.engine.runner_config import RunnerConfig
    from flashpd.engine.sampling import SamplingParams
    from flashpd.engine.scheduler import generate
    from flashpd.engine.spec_decode import DFlashGenerator
    from test_paged_attention import tiny_pair

    target, drafter = tiny_pair(dev, 16, 1e6, seed=4)
    prompts = [[3, 9, 27, 17], [5, 1, 8]]
    params = [SamplingParams(max_tokens=7, ignore_eos=True)] * 2

    def run(spec: bool) -> list:
        runner = ModelRunner(target, 64, 8, taps=(0, 1), config=RunnerConfig(
            cuda_graphs=False, compile=False, attention_impl="paged"))
        if spec:
            return [(s.output, s.stats.acceptance_lengths)
                    for s in generate(DFlashGenerator(runner, drafter, (), 8), prompts, params, [8, 8])]
        return [(s.output, s.stats.acceptance_lengths) for s in generate(NativeGenerator(runner), prompts, params)]

    calls, real = [], pa.paged_attention_rope

    def spy(qkv, *rest, **kw):
        calls.append(qkv.shape[0])
        return real(qkv, *rest, **kw)

    saved = pa.FUSED_ROPE
    try:
        for spec in (False, True):
            pa.FUSED_ROPE = False
            off = run(spec)
            pa.FUSED_ROPE = True
            pa.paged_attention_rope = spy
            try:
                on = run(spec)
            finally:
                pa.paged_attention_rope = real
            assert on == off, spec
            assert all(len(r[0]) == 7 for r in on)
            if not spec:  # native: 6 one-token steps after the prefill, 2 layers each (rows batched together)
                assert len(calls) >= 12, calls
            calls.clear()
    finally:
        pa.FUSED_ROPE = saved


CASES["engine-decode"] = the_engine_decode_takes_it


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str) -> None:
    check_case(sys.modules[__name__], name)


def test_it_applies_to_one_token_rows_only():
    """rope_applies: never on a CPU without the interpreter (this process), never to a verify's rows."""
    x = torch.zeros(2, 1, (8 + 4) * 32)
    assert not engine_pa.rope_applies(x, 1, 8, 2, 32)
    if torch.cuda.is_available():  # pragma: no cover (GPU machines)
        xc = x.cuda().bfloat16()
        assert engine_pa.rope_applies(xc, 1, 8, 2, 32) and not engine_pa.rope_applies(xc, 16, 8, 2, 32)

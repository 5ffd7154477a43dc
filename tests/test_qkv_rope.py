"""The fused q/k norm, RoPE, query layout and cache write (engine/qkv_rope.py) against the plain-PyTorch steps it
replaces in qwen3.attn_inputs, its row invariance, its cache writes, and the compiled op.

Without a GPU the kernel runs under triton's interpreter in one child process started with TRITON_INTERPRET=1
(tests/_interpreted.py says why); on a GPU the cases run here on CUDA tensors."""
from __future__ import annotations

import contextlib
import sys
from types import ModuleType
from typing import Callable, Iterator

import pytest
import torch
from _interpreted import check as check_case

import flashpd.engine.qkv_rope as engine_qr
from flashpd.engine.attention import group_queries, write_kv
from flashpd.engine.layers import Rotary, apply_rotary, rms_norm

CASES: dict[str, Callable[[ModuleType, str], None]] = {}
KERNELS = engine_qr  # the module the cases take (tests/_interpreted.py)
N_Q, N_KV, D, EPS = 8, 2, 32, 1e-6


def operands(dev: str, dtype: torch.dtype, b: int, t: int, seed: int) -> dict:
    """QKV rows, RoPE tables at random positions, norm weights, a cache of 6 blocks of 8 slots (random values)
    and distinct slots for the B*T tokens."""
    g = torch.Generator().manual_seed(seed)
    rot = Rotary(D, 1e6, 512, "cpu")
    pos = torch.randint(0, 512, (b, t), generator=g)
    cos, sin = rot.tables(pos, dtype)
    return {"qkv": torch.randn(b, t, (N_Q + 2 * N_KV) * D, generator=g).to(dev, dtype) * 3,
            "cos": cos.to(dev), "sin": sin.to(dev),
            "w_qn": (1 + torch.randn(D, generator=g) / 4).to(dev, dtype),
            "w_kn": (1 + torch.randn(D, generator=g) / 4).to(dev, dtype),
            "cache": torch.randn(2, 48, N_KV, D, generator=g).to(dev, dtype),
            "slots": torch.randperm(48, generator=g)[:b * t].to(dev)}


def plain(o: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """attn_inputs' plain-PyTorch steps after the matmul, in fp32: the queries, and the cache after the write."""
    b, t, _ = o["qkv"].shape
    qkv = o["qkv"].float()
    q, k, v = qkv.split([N_Q * D, N_KV * D, N_KV * D], dim=-1)
    cos, sin = o["cos"].float(), o["sin"].float()
    q = group_queries(apply_rotary(rms_norm(q.view(b, t, N_Q, D), o["w_qn"].float(), EPS), cos, sin), N_KV)
    k = apply_rotary(rms_norm(k.view(b, t, N_KV, D), o["w_kn"].float(), EPS), cos, sin).reshape(b * t, N_KV, D)
    cache = o["cache"].float().clone()
    write_kv(cache[0], cache[1], o["slots"], k, v.reshape(b * t, N_KV, D))
    return q, cache


def fused(qr: ModuleType, o: dict) -> tuple[torch.Tensor, torch.Tensor]:
    cache = o["cache"].clone()
    q = qr.qkv_rope_write(o["qkv"], o["cos"], o["sin"], o["w_qn"], o["w_kn"], EPS, N_Q, N_KV, cache[0], cache[1],
                          o["slots"])
    return q, cache


def matches_the_plain_steps(qr: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """Decode (T=1) and verify-like (T=5) calls: the queries in the paged kernel's layout and every written slot
    close to the plain steps (fp32: to rounding; bf16: within its rounding of fp32 results), each value copied
    exactly, and every other slot of the cache untouched."""
    for b, t in ((3, 1), (2, 5)):
        o = operands(dev, dtype, b, t, seed=b * 10 + t)
        assert qr.applies(o["qkv"], N_Q, N_KV, D)
        q, cache = fused(qr, o)
        ref_q, ref_cache = plain(o)
        assert q.dtype == dtype and q.shape == (N_KV, b, t * N_Q // N_KV, D)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(q.float(), ref_q, rtol=tol, atol=tol)
        torch.testing.assert_close(cache.float(), ref_cache.to(dtype).float(), rtol=tol, atol=tol)
        vals = o["qkv"].reshape(b * t, -1)[:, (N_Q + N_KV) * D:].reshape(b * t, N_KV, D)
        assert torch.equal(cache[1][o["slots"]], vals)
        others = torch.ones(48, dtype=torch.bool, device=dev)
        others[o["slots"]] = False
        assert torch.equal(cache[:, others], o["cache"][:, others])


for _dt in (torch.float32, torch.bfloat16):
    CASES[f"plain-{str(_dt)[6:]}"] = lambda qr, dev, dt=_dt: matches_the_plain_steps(qr, dev, dt)


def tokens_do_not_depend_on_the_call(qr: ModuleType, dev: str) -> None:
    """A token's queries and K/V are bitwise the same alone (B=1, T=1) and inside a call of 3 rows of 4 tokens."""
    o = operands(dev, torch.bfloat16, 3, 4, seed=5)
    q, cache = fused(qr, o)
    for b, t in ((0, 0), (1, 2), (2, 3)):
        one = {**o, "qkv": o["qkv"][b:b + 1, t:t + 1].contiguous(), "cos": o["cos"][b:b + 1, t:t + 1].contiguous(),
               "sin": o["sin"][b:b + 1, t:t + 1].contiguous(), "slots": o["slots"][b * 4 + t:b * 4 + t + 1]}
        q1, cache1 = fused(qr, one)
        g = N_Q // N_KV
        assert torch.equal(q1[:, 0], q[:, b, t * g:(t + 1) * g]), (b, t)
        slot = int(o["slots"][b * 4 + t])
        assert torch.equal(cache1[:, slot], cache[:, slot]), (b, t)


CASES["invariance"] = tokens_do_not_depend_on_the_call


def fixed_order(case: Callable[..., None]) -> Callable[..., None]:
    """A case with qkv_rope.IN_ATTENTION on: the kernel's fixed-order form (norm_rope)."""
    def run(qr: ModuleType, dev: str, *args) -> None:
        with in_attention(qr):
            case(qr, dev, *args)
    return run


for _dt in (torch.float32, torch.bfloat16):
    CASES[f"plain-fixed-{str(_dt)[6:]}"] = lambda qr, dev, dt=_dt: fixed_order(matches_the_plain_steps)(qr, dev, dt)
CASES["invariance-fixed"] = fixed_order(tokens_do_not_depend_on_the_call)


def compiled_op_is_the_eager_op(qr: ModuleType, dev: str) -> None:
    """torch.compile of a caller that takes the whole cache and makes its [slots, heads, d] K and V views itself:
    the same queries and the same cache, written in place (on a GPU through inductor; on the CPU through
    aot_eager: the op's fake and functionalization).

    The views are made inside the compiled function on purpose. Passed in as two inputs (views of one storage,
    V's at an offset), torch's inductor (2.11, on an H200) clones "the base" from V's own pointer at the base's
    size, reading past the cache's end, and copies that back over V's unwritten slots (pytorch/pytorch#139628,
    #192226). The engine calls the op eagerly, outside torch.compile, so it never meets that path."""
    o = operands(dev, torch.bfloat16, 2, 3, seed=9)

    def f(qkv, cos, sin, w_qn, w_kn, kv, slots):
        return qr.qkv_rope_write(qkv, cos, sin, w_qn, w_kn, EPS, N_Q, N_KV, kv[0], kv[1], slots) * 2

    torch._dynamo.reset()
    backend = "inductor" if dev == "cuda" else "aot_eager"
    cache = o["cache"].clone()
    out = torch.compile(f, fullgraph=True, backend=backend)(o["qkv"], o["cos"], o["sin"], o["w_qn"], o["w_kn"],
                                                             cache, o["slots"])
    q, ref_cache = fused(qr, o)
    assert torch.equal(out, q * 2) and torch.equal(cache, ref_cache)


CASES["compiled"] = compiled_op_is_the_eager_op


def the_engine_takes_it_on_the_paged_path(qr: ModuleType, dev: str) -> None:
    """qwen3.fused_attn_inputs: the kernel over the QKV matmul's output where it applies, None where it does not
    (a head dim of 24). Through a whole DFlash engine on the paged path (RunnerConfig.attention_impl "paged") both
    the target's layers (its verify) and the drafter's (its paged pass) take it: a spy on qkv_rope_write records
    whose q-norm weight each call carries. That engine's tokens and acceptance lengths against the gathered path
    (the plain steps) are test_paged_attention's "dflash-paged-engine" case, at this same tiny pair. With
    qkv_rope.IN_ATTENTION on, the fused layer's calls take its work inside the paged attention
    (paged_attention_rope, spied on too), walking and with a program per key chunk, and DFlash's tokens are native's
    (at the verify's width) under the same switch; in fp32 on the CPU also the tokens and acceptance lengths of the
    switch off. On a GPU the pair is bf16, where the fused layers run."""
    from flashpd.engine.qwen3 import fused_attn_inputs
    from flashpd.engine.runner import ModelRunner
    from flashpd.engine.runner_config import RunnerConfig
    from flashpd.engine.sampling import SamplingParams
    from flashpd.engine.scheduler import generate
    from flashpd.engine.spec_decode import DFlashGenerator
    from test_paged_attention import tiny_pair

    o = operands(dev, torch.float32, 2, 3, seed=11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 16, generator=g).to(dev)
    w_qkv = (torch.randn((N_Q + 2 * N_KV) * D, 16, generator=g) / 4).to(dev)
    c1, c2 = o["cache"].clone(), o["cache"].clone()
    q = fused_attn_inputs(x, o["cos"], o["sin"], w_qkv, o["w_qn"], o["w_kn"], EPS, N_Q, N_KV, D, c1[0], c1[1],
                          o["slots"])
    ref = qr.qkv_rope_write(x @ w_qkv.T, o["cos"], o["sin"], o["w_qn"], o["w_kn"], EPS, N_Q, N_KV, c2[0], c2[1],
                            o["slots"])
    assert torch.equal(q, ref) and torch.equal(c1, c2)
    assert fused_attn_inputs(x[..., :12], o["cos"][..., :24], o["sin"][..., :24], w_qkv[:, :12], o["w_qn"][:24],
                             o["w_kn"][:24], EPS, N_Q, N_KV, 24, c1[0, :, :, :24], c1[1, :, :, :24], o["slots"]) is None

    from flashpd.engine import qwen3
    from flashpd.engine.generate import NativeGenerator
    # bf16 on a GPU, where the fused layers run in bf16 and fp16 only (the interpreter takes fp32 too)
    target, drafter = tiny_pair(dev, 16, 1e6, seed=4, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    real, real_pa = qr.qkv_rope_write, qwen3.paged_attention_rope

    def run(spec: bool = True) -> tuple[list[int], set[int], set[int]]:
        runner = ModelRunner(target, 48, 8, taps=(0, 1), config=RunnerConfig(
            cuda_graphs=False, compile=False, attention_impl="paged"))
        # native at the verify's width: its steps take the verify's kernel shapes (NativeGenerator's step_width)
        gen = DFlashGenerator(runner, drafter, (), 8) if spec else NativeGenerator(runner, (), step_width=8)
        seen, fused = set(), set()

        def spy(qkv, cos, sin, w_qn, *rest):
            seen.add(w_qn.data_ptr())
            return real(qkv, cos, sin, w_qn, *rest)

        def spy_pa(qkv, k_cache, v_cache, bt, pos, scale, cos, sin, w_qn, *rest, **kw):
            fused.add(w_qn.data_ptr())
            return real_pa(qkv, k_cache, v_cache, bt, pos, scale, cos, sin, w_qn, *rest, **kw)

        qr.qkv_rope_write, qwen3.paged_attention_rope = spy, spy_pa
        try:
            # a 28-token prompt: the verifies and draft blocks cross key 32, a chunk's end
            out = generate(gen, [[3, 9, 27, 17] * 7], [SamplingParams(max_tokens=10, ignore_eos=True)],
                           [8] if spec else None)
        finally:
            qr.qkv_rope_write, qwen3.paged_attention_rope = real, real_pa
        assert len(out[0].output) == 10
        return list(out[0].output) + list(out[0].stats.acceptance_lengths), seen, fused

    target_norms = {l.self_attn.q_norm.weight.data_ptr() for l in target.layers}
    draft_norms = {l.q_norm.data_ptr() for l in drafter.layers}
    with in_attention(qr, on=False):
        tokens, seen, fused = run()
    assert seen & target_norms and seen & draft_norms and seen <= target_norms | draft_norms and not fused
    from flashpd.engine import paged_attention as pa
    split_below = pa.SPLIT_BELOW_PROGRAMS_PER_SM
    try:
        with in_attention(qr):
            native = run(spec=False)[0]
            # qwen3.fused_layer's calls take the work inside the paged attention's launch; as the engine splits
            # the keys (the interpreter counts one SM: its calls walk), then with a program per key chunk
            for pa.SPLIT_BELOW_PROGRAMS_PER_SM in (split_below, 1 << 20):
                tokens_in, seen_in, fused_in = run()
                assert fused_in and (seen_in | fused_in) & target_norms and (seen_in | fused_in) & draft_norms
                assert tokens_in[:10] == native[:10]  # DFlash is native, token for token
                if dev == "cpu":  # fp32, where the switch moves no token: the two kernels' run, acceptance too
                    assert tokens_in == tokens
    finally:
        pa.SPLIT_BELOW_PROGRAMS_PER_SM = split_below


CASES["attn-inputs"] = the_engine_takes_it_on_the_paged_path


def attention_rope_is_the_two_kernels(qr: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """paged_attention.paged_attention_rope (one launch) against qkv_rope_write then paged_attention: bitwise the
    same output and the same cache, for decodes, verifies and the drafter's block (queries bounded by the block's
    last position), one key chunk or several, a program per chunk or one walking them, in either output layout
    (qkv_rope.IN_ATTENTION on: both take norm_rope's sums)."""
    from flashpd.engine import paged_attention as pa
    with in_attention(qr):
        _attention_rope_cases(qr, pa, dev, dtype)


@contextlib.contextmanager
def in_attention(qr: ModuleType, on: bool = True) -> Iterator[None]:
    saved, qr.IN_ATTENTION = qr.IN_ATTENTION, on
    try:
        yield
    finally:
        qr.IN_ATTENTION = saved


def _attention_rope_cases(qr: ModuleType, pa: ModuleType, dev: str, dtype: torch.dtype) -> None:
    # (rows, tokens a row, table blocks, split, the drafter's form: every query bounded by its row's last position,
    # each token's key at its own; its rows' blocks straddle a 32-key chunk's end, so that a chunk's reader is not
    # the program holding the last position)
    forms = ((1, 1, 12, True, False), (3, 1, 25, False, False), (2, 5, 12, True, False), (2, 16, 25, True, False),
             (2, 16, 25, False, False), (1, 3, 3, False, False), (2, 8, 12, True, True), (2, 8, 12, False, True))
    for seed, (b, t, nblk, split, draft) in enumerate(forms):
        _, k, v, bt, pos = pa.random_case(b, t, N_KV, N_Q // N_KV, D, 8, nblk, 160, dtype, dev, seed=seed)
        g = torch.Generator().manual_seed(seed)
        # no block in two rows' tables (random_case draws each row's apart): a sequence's writes go to blocks it
        # alone holds, as the engine's block tables have it (the paged pass writes and reads in one launch)
        used = bt != 0
        bt = torch.zeros_like(bt)
        bt[used] = (torch.randperm(159, generator=g)[:int(used.sum())] + 1).to(bt.device)
        if draft:
            bt[:, :nblk] = (torch.randperm(159, generator=g)[:b * nblk] + 1).view(b, nblk).to(bt.device)
            pos = (torch.tensor([[28], [61]])[:b] + torch.arange(t)).to(dev)  # keys 28-35 and 61-68
        bound = pos[:, -1:].expand_as(pos).contiguous() if draft else pos
        rot = Rotary(D, 1e6, 512, "cpu")
        cos, sin = (x.to(dev) for x in rot.tables(pos.cpu(), dtype))
        qkv = (torch.randn(b, t, (N_Q + 2 * N_KV) * D, generator=g) * 3).to(dev, dtype)
        w_qn = (1 + torch.randn(D, generator=g) / 4).to(dev, dtype)
        w_kn = (1 + torch.randn(D, generator=g) / 4).to(dev, dtype)
        slots = (bt.gather(1, pos // 8) * 8 + pos % 8).reshape(-1).contiguous()
        case = (b, t, nblk, split, draft)
        k1, v1 = k.clone(), v.clone()  # the two kernels' cache: qkv_rope_write's output is either layout's input
        q = qr.qkv_rope_write(qkv, cos, sin, w_qn, w_kn, EPS, N_Q, N_KV, k1.view(-1, N_KV, D), v1.view(-1, N_KV, D),
                              slots)
        assert not torch.equal(k1, k)  # the call's keys were written
        for heads_last in (False, True):
            k2, v2 = k.clone(), v.clone()
            ref = pa.launch(q, k1, v1, bt, bound, D ** -0.5, split, heads_last=heads_last)
            out = pa.launch(qkv, k2, v2, bt, bound, D ** -0.5, split, heads_last=heads_last,
                            rope=pa.RopeInputs(cos, sin, w_qn, w_kn, EPS, N_Q, slots, pos.contiguous()))
            assert torch.equal(out, ref), case + (heads_last,)
            assert torch.equal(k2, k1) and torch.equal(v2, v1), case + (heads_last,)
        op = pa.paged_attention_rope(qkv, k.clone(), v.clone(), bt, bound, D ** -0.5, cos, sin, w_qn, w_kn, EPS, N_Q,
                                     slots, pos, heads_last=True)
        assert torch.equal(op, ref), case


for _dt in (torch.float32, torch.bfloat16):
    CASES[f"attention-rope-{str(_dt)[6:]}"] = lambda qr, dev, dt=_dt: attention_rope_is_the_two_kernels(qr, dev, dt)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str) -> None:
    check_case(sys.modules[__name__], name)


def test_the_cpu_keeps_the_plain_steps():
    """Without the interpreter (this process) the CPU never takes the kernel: exactness tests there compare the
    plain steps with transformers' model."""
    x = torch.zeros(1, 1, (N_Q + 2 * N_KV) * D)
    assert not engine_qr.applies(x, N_Q, N_KV, D)
    if torch.cuda.is_available():  # pragma: no cover (GPU machines)
        assert engine_qr.applies(x.cuda().bfloat16(), N_Q, N_KV, D)
        assert not engine_qr.applies(x.cuda(), N_Q, N_KV, 24)  # head dim not a power of two

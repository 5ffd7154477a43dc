"""The Triton paged attention kernel (engine/paged_attention.py) against the gather + mask + softmax path it
replaces, and its batch invariance: a row's output is bitwise the same whatever shares its forward.

Without a GPU the kernels run under triton's interpreter (numpy on CPU tensors) in one child process that runs
every case below and reports each (tests/_interpreted.py says why); each test here checks its case's report. On a
GPU the cases run in this process on CUDA tensors."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable

import pytest
import torch
from _interpreted import check as check_case

import flashpd.engine.attention as attention
import flashpd.engine.paged_attention as engine_pa

SCALE = 24 ** -0.5
CASES: dict[str, Callable[[ModuleType, str], None]] = {}
KERNELS = engine_pa  # the module the cases take (tests/_interpreted.py)


def random_case(pa: ModuleType, device: str, dtype: torch.dtype, b: int, t: int, nblk: int, seed: int,
                min_pos: int = 0, hkv: int = 2) -> tuple[torch.Tensor, ...]:
    """4 query groups, head_dim 24 (padded to 32 in the kernel), blocks of 8 keys, 64 blocks."""
    return pa.random_case(b, t, hkv, 4, 24, 8, nblk, 64, dtype, device, seed=seed, min_pos=min_pos)


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def matches_the_gathered_reference(pa: ModuleType, dev: str, dtype: torch.dtype, b: int, t: int, nblk: int,
                                   split: bool) -> None:
    """Rows at different positions, decode (T=1) and verify (T=16, G=4), padded table entries (the scratch
    block 0 holds random data), keys over 2 (96 keys) or 4 chunks (200 keys, rows past key 70), each chunk in a
    program of its own merged by the combine kernel (split) or all merged in one program."""
    q, k, v, bt, pos = random_case(pa, dev, dtype, b, t, nblk, seed=b * 10 + t, min_pos=70 if nblk > 20 else 0)
    assert (bt == 0).any()  # some table entries are padding
    assert pos.max() >= pa.KEYS_PER_CHUNK  # two chunks or more
    out = pa.paged_attention(q, k, v, bt, pos, SCALE, split=split)
    ref = pa.reference(q.float(), k.float(), v.float(), bt, pos, SCALE)
    check_close(out, ref, dtype)


for _dt in (torch.float32, torch.bfloat16):
    for _b, _t, _nblk, _split in ((3, 1, 12, False), (2, 16, 12, True), (3, 2, 25, True), (3, 2, 25, False)):
        CASES[f"reference-{str(_dt)[6:]}-b{_b}-t{_t}-nblk{_nblk}-split{int(_split)}"] = (
            lambda pa, dev, a=(_dt, _b, _t, _nblk, _split): matches_the_gathered_reference(pa, dev, *a))


def unwritten_slots_are_never_read(pa: ModuleType, dev: str) -> None:
    """Cache slots past every query's position (here NaN) leave the output finite and unchanged: keys past a
    tile's last position are masked loads, not zero-weighted ones."""
    q, k, v, bt, pos = random_case(pa, dev, torch.float32, 2, 4, 10, seed=7)
    ref = pa.paged_attention(q, k, v, bt, pos, SCALE)
    for i in range(bt.shape[0]):
        for key in range(int(pos[i].max()) + 1, bt.shape[1] * 8):
            k[bt[i, key // 8], key % 8] = float("nan")
            v[bt[i, key // 8], key % 8] = float("nan")
    out = pa.paged_attention(q, k, v, bt, pos, SCALE)
    assert torch.equal(out, ref)


CASES["unwritten-slots"] = unwritten_slots_are_never_read


def rows_do_not_depend_on_their_batch(pa: ModuleType, dev: str, dtype: torch.dtype) -> None:
    """A row computed alone (B=1, T=1), inside a verify of T=16 beside rows at other positions, and inside a
    call with a wider block table is bitwise the same, wherever it sits in its row tile (cols 0, 9 and 15),
    with its key chunks merged in one program or each chunk in its own program and the combine kernel (in
    several of its forms, for the verify's call and the row's own): rows within the first chunk or few
    (min_pos 30) and rows over several (min_pos 130), where the wider table adds more chunks past every row."""
    for min_pos in (30, 130):
        q, k, v, bt, pos = random_case(pa, dev, dtype, 1, 16, 20, seed=min_pos, min_pos=min_pos, hkv=1)
        full = pa.paged_attention(q, k, v, bt, pos, SCALE, split=False)
        assert torch.equal(pa.paged_attention(q, k, v, bt, pos, SCALE, split=True), full), min_pos
        wide = torch.cat([bt, torch.zeros_like(bt)], dim=1)  # 320 keys: 10 chunks of 32
        for split in (False, True):
            assert torch.equal(pa.paged_attention(q, k, v, wide, pos, SCALE, split=split), full), (min_pos, split)
            for col in (0, 9, 15):
                rows = slice(col * 4, col * 4 + 4)
                alone = pa.paged_attention(q[:, :, rows].contiguous(), k, v, bt, pos[:, col:col + 1], SCALE,
                                           split=split)
                assert torch.equal(alone, full[:, :, rows]), (min_pos, split, col)
        # the combine kernel's forms (rows and columns a program, chunk states an iteration, warps), a verify's
        # call and a one-token call's: 16 rows over every column (the old form), a decode's 4 rows over column
        # slices of 16 (24 columns padded to 32: a slice past the head's columns stores nothing), 8 rows
        for form in ((16, 128, 1, 4), (16, 32, 2, 2), (4, 16, 4, 1), (8, 16, 3, 4), (4, 32, 8, 2)):
            with pa.forced_combine(*form):
                assert torch.equal(pa.paged_attention(q, k, v, wide, pos, SCALE, split=True), full), form
                alone = pa.paged_attention(q[:, :, 36:40].contiguous(), k, v, wide, pos[:, 9:10], SCALE, split=True)
                assert torch.equal(alone, full[:, :, 36:40]), (min_pos, form)


def heads_last_is_the_same_numbers_in_o_proj_order(pa: ModuleType, dev: str) -> None:
    """The kernel writing [B, T, Hq*d] itself gives bitwise attention.heads_last of its kv-major output, in
    one program per row and with a program per chunk (the combine kernel writes that case)."""
    for split in (False, True):
        q, k, v, bt, pos = random_case(pa, dev, torch.bfloat16, 2, 3, 20, seed=int(split), min_pos=70)
        kv_major = pa.paged_attention(q, k, v, bt, pos, SCALE, split=split)
        out = pa.paged_attention(q, k, v, bt, pos, SCALE, heads_last=True, split=split)
        assert out.shape == (2, 3, 2 * 4 * 24)
        assert torch.equal(out, attention.heads_last(kv_major, 3)), split


CASES["heads-last"] = heads_last_is_the_same_numbers_in_o_proj_order


def compiles_at_a_verify_width_with_expanded_positions(pa: ModuleType, dev: str) -> None:
    """torch.compile of a caller that passes one position expanded over a verify's width, as a native decode at
    the verify's shapes does, a program per key chunk: the compiled call gives the eager bits. On a GPU through
    inductor (a triton_op form of the kernel failed in its scheduler on exactly this call on an H200); on the
    CPU through aot_eager (the op's fake and functionalization; inductor's CPU code adds only a C++ compile)."""
    q, k, v, bt, pos = random_case(pa, dev, torch.float32, 3, 16, 20, seed=5, min_pos=70)

    def f(q, k, v, bt, p1):
        return pa.paged_attention(q, k, v, bt, p1.expand(3, 16), SCALE, heads_last=True, split=True) * 2

    torch._dynamo.reset()
    backend = "inductor" if dev == "cuda" else "aot_eager"
    assert torch.equal(torch.compile(f, fullgraph=True, backend=backend)(q, k, v, bt, pos[:, :1]),
                       f(q, k, v, bt, pos[:, :1]))


CASES["compiled-verify-width"] = compiles_at_a_verify_width_with_expanded_positions
CASES["invariance-float32"] = lambda pa, dev: rows_do_not_depend_on_their_batch(pa, dev, torch.float32)
CASES["invariance-bfloat16"] = lambda pa, dev: rows_do_not_depend_on_their_batch(pa, dev, torch.bfloat16)


def tiny_pair(dev: str, head_dim: int, drafter_theta: float, seed: int, dtype: torch.dtype = torch.float32
              ) -> tuple:
    """A random target (2 layers, vocabulary 64; fp32 unless `dtype`) and a 2-layer drafter of block 8 on it, the
    drafter's q/k/v scaled up so that its attention is far from uniform."""
    from flashpd.engine.config import Qwen3Config
    from flashpd.engine.drafter import DFlashConfig, dummy_drafter
    from flashpd.engine.loader import dummy_target

    tcfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256)
    dcfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=drafter_theta,
                        block_size=8, num_target_layers=2, target_layer_ids=(0, 1), mask_token_id=63)
    target = dummy_target(tcfg, dev, dtype, seed=seed)
    drafter = dummy_drafter(dcfg, target, seed=seed + 1)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.qkv_proj.mul_(10)
    return target, drafter


def draft_pass_in_place_is_the_gathered_pass(pa: ModuleType, dev: str, head_dim: int = 24,
                                             ctx: tuple[int, ...] = (5, 70, 20),
                                             widths: tuple[int, ...] = (8, 3, 6),
                                             dtype: torch.dtype = torch.float32) -> None:
    """The drafter's paged pass (DFlashDrafter.paged_block_hidden: each layer writes its block's K/V at the
    block's slots and attends in place) against its gathered pass (context gathered, mask, concatenated block
    K/V) in fp32: rows of different context lengths (one within a chunk, one over several) and widths, block
    tables of scattered blocks padded with the scratch block. Each row's logits within its width agree, and the
    pass writes nothing but its rows' block slots and the scratch block: every context slot is untouched."""
    target, drafter = tiny_pair(dev, head_dim, 10000.0, seed=1, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    bs, nb, t = 8, 24, 8
    cache = torch.randn(2, 2, nb, bs, 2, head_dim, generator=gen).to(dev, dtype)  # context K/V of every slot
    ctx, widths, rows = list(ctx), list(widths), len(ctx)
    blocks = (torch.randperm(nb - 1, generator=gen) + 1).tolist()  # block 0: scratch
    nblk = 11
    bt = torch.zeros(rows, nblk, dtype=torch.int64)
    for i, c in enumerate(ctx):
        need = (c + t + bs - 1) // bs
        bt[i, :need] = torch.tensor([blocks.pop() for _ in range(need)])
    ar = torch.arange(t)
    c_t, w_t = torch.tensor(ctx), torch.tensor(widths)
    pos = torch.minimum(c_t[:, None] + ar, (c_t + w_t - 1)[:, None])
    slots = bt.gather(1, pos // bs) * bs + pos % bs
    slots = torch.where(ar < w_t[:, None], slots, 0)  # past a row's width: the scratch block
    ids = torch.randint(0, 63, (rows, t), generator=gen)
    ids[:, 1:] = 63
    bt, pos, slots, ids, c_t, w_t = (x.to(dev) for x in (bt, pos, slots, ids, c_t, w_t))
    with torch.no_grad():
        ref = drafter.draft_logits(ids, pos, cache.clone(), bt, c_t, w_t)
        paged_cache = cache.clone()
        out = drafter.draft_logits(ids, pos, paged_cache, bt, c_t, w_t, attention_impl="paged",
                                   block_slots=slots.reshape(-1))
    for i, w in enumerate(widths):
        if dtype == torch.float32:
            torch.testing.assert_close(out[i, :w - 1], ref[i, :w - 1], rtol=2e-5, atol=2e-5)
            assert torch.equal(out[i, :w - 1].argmax(-1), ref[i, :w - 1].argmax(-1))
        else:  # bf16's rounding, step by step in two kernel sets (a key never written is off by far more)
            torch.testing.assert_close(out[i, :w - 1].float(), ref[i, :w - 1].float(), rtol=3e-2, atol=3e-2)
    changed = (paged_cache != cache).reshape(2, 2, nb * bs, -1).any(-1).any(0).any(0)  # per flat slot
    written = torch.zeros(nb * bs, dtype=torch.bool, device=dev)
    written[slots.reshape(-1)] = True
    written[:bs] = True  # the scratch block
    assert changed.any() and not (changed & ~written).any()


CASES["draft-pass"] = draft_pass_in_place_is_the_gathered_pass


def draft_pass_with_rope_in_attention(pa: ModuleType, dev: str) -> None:
    """The same with qkv_rope.IN_ATTENTION on, at a head dim the fused layer takes (16): the paged kernel writes
    the block's keys itself, each at its own key index, while every query sees to the block's last position; the
    second row's block (keys 27-32) straddles a 32-key chunk's end, so its first keys are read by a program that
    does not hold the last position. Once as the engine splits the keys, once with a program per chunk (on a GPU
    a decode's or a draft's call takes it; under the interpreter, which counts one SM, it walks)."""
    import flashpd.engine.qkv_rope as qr
    from flashpd.engine import qwen3

    calls, real = [], qwen3.paged_attention_rope

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    saved, qr.IN_ATTENTION, qwen3.paged_attention_rope = qr.IN_ATTENTION, True, spy
    split_below = pa.SPLIT_BELOW_PROGRAMS_PER_SM
    try:
        for pa.SPLIT_BELOW_PROGRAMS_PER_SM in (split_below, 1 << 20):  # as the engine picks; a program per chunk
            # 16 rows: the fused layer's; bf16 on a GPU, where the fused layers run in bf16 and fp16 only
            draft_pass_in_place_is_the_gathered_pass(pa, dev, 16, (70, 27), (3, 6),
                                                     torch.bfloat16 if dev == "cuda" else torch.float32)
    finally:
        qr.IN_ATTENTION, qwen3.paged_attention_rope = saved, real
        pa.SPLIT_BELOW_PROGRAMS_PER_SM = split_below
    assert calls  # the fused layer took it


CASES["draft-pass-rope-in-attention"] = draft_pass_with_rope_in_attention


def dflash_on_the_paged_kernel_is_the_gathered_dflash(pa: ModuleType, dev: str) -> None:
    """DFlash through a whole engine with every decode, verify and draft pass on the paged kernel
    (RunnerConfig.attention_impl "paged") against the gathered matmul form, fp32, random tiny models:
    - DraftRunner.draft over rows of different contexts, widths (2-8) and pending context rows (the step's own
      context write, then the block's K/V at its block slots): each row's logits within its width agree;
    - generation of three prompts at width 8: the same tokens and the same acceptance lengths, step by step."""
    from flashpd.engine.runner import ModelRunner
    from flashpd.engine.runner_config import RunnerConfig
    from flashpd.engine.sampling import SamplingParams
    from flashpd.engine.scheduler import generate
    from flashpd.engine.sequence import Sequence
    from flashpd.engine.spec_decode import DFlashGenerator

    target, drafter = tiny_pair(dev, 16, 1e6, seed=4)
    gens = {impl: DFlashGenerator(ModelRunner(target, 48, 8, taps=(0, 1), config=RunnerConfig(
        cuda_graphs=False, compile=False, attention_impl=impl)), drafter, (), 8) for impl in ("matmul", "paged")}
    rows = [(9, 8, 0), (37, 3, 2), (20, 6, 5)]  # (context, width, pending rows)
    feats = [torch.randn(c, 64, generator=torch.Generator().manual_seed(c)).to(dev) for c, _, _ in rows]
    logits = {}
    for impl, gen in gens.items():
        alloc, seqs = gen.runner.allocator, []
        for (c, w, n), f in zip(rows, feats):
            s = Sequence(list(range(1, c + 1)), SamplingParams(max_tokens=8, ignore_eos=True), frozenset())
            s.output = [c % 60]
            alloc.ensure(s.table, c + w)
            s.table.num_tokens = c
            seqs.append(s)
        gen.drafts.write_prompt(seqs, [f[:f.shape[0] - n] for f, (_, _, n) in zip(feats, rows)])
        for s, f, (c, _, n) in zip(seqs, feats, rows):
            if n:
                s.pending, s.pending_rows = f[c - n:], n
        logits[impl] = gen.drafts.draft(seqs, [w for _, w, _ in rows])
        for s in seqs:
            alloc.free(s.table)
    for i, (_, w, _) in enumerate(rows):
        torch.testing.assert_close(logits["paged"][i, :w - 1], logits["matmul"][i, :w - 1], rtol=2e-5, atol=2e-5)
    prompts = [[3, 9, 27, 17], list(range(5, 30)), [11] * 12]
    out = {impl: generate(gen, prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * 3, [8] * 3)
           for impl, gen in gens.items()}
    for a, b in zip(out["paged"], out["matmul"]):
        assert a.output == b.output and a.stats.acceptance_lengths == b.stats.acceptance_lengths


CASES["dflash-paged-engine"] = dflash_on_the_paged_kernel_is_the_gathered_dflash


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(name: str) -> None:
    check_case(sys.modules[__name__], name)


def test_the_engine_dispatches_decode_and_verify_on_a_gpu_only():
    q = torch.zeros(8, 4, 4, 128)
    assert not attention.use_paged(q, 1)  # the CPU keeps grouped_attention, bitwise as before
    if torch.cuda.is_available():  # pragma: no cover (GPU machines)
        qc = q.cuda()
        assert attention.use_paged(qc, 1) and attention.use_paged(qc[:, :1], 1)  # decode at any batch
        assert attention.use_paged(qc[:, :1], 16)  # a verify at any batch
        assert attention.use_paged(qc, attention.PAGED_MAX_T)
        assert not attention.use_paged(qc, attention.PAGED_MAX_T + 1)  # prefill chunks
        assert not attention.use_paged(qc, 1, "matmul")  # a forced form
    assert engine_pa.KEYS_PER_CHUNK % engine_pa.BLOCK_N == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="warps exist on a GPU only (the interpreter runs a "
                    "program as one thread)")
def test_no_bit_depends_on_the_warps():  # pragma: no cover (GPU machines)
    """The engine picks warps per call (walking or a program per chunk): a row's weight sum is an MMA, so 1, 2, 4
    and 8 warps give the same bits, decode and verify, walking and per chunk."""
    for t, nblk in ((1, 40), (16, 40)):
        q, k, v, bt, pos = random_case(engine_pa, "cuda", torch.bfloat16, 5, t, nblk, seed=t, min_pos=300)
        ref = engine_pa.launch(q, k, v, bt, pos, SCALE, False)
        for split in (False, True):
            for warps in (1, 2, 4, 8):
                assert torch.equal(engine_pa.launch(q, k, v, bt, pos, SCALE, split, num_warps=warps), ref), (t, warps)


def test_walking_programs_take_the_register_cap_past_one_wave_only():
    """The 128-register cap (WALK_MAX_REGISTERS) applies past WALK_CAP_ABOVE_PROGRAMS_PER_SM walking programs an
    SM (at the 8B shape on 132 SMs: batch 128's 1,024 and up, not batch 64's 512, where it measured slower), and
    neither constant at 0 applies it."""
    sms = 132
    assert engine_pa.walk_register_cap(8 * 128, sms) == engine_pa.WALK_MAX_REGISTERS == 128
    assert engine_pa.walk_register_cap(8 * 64, sms) is None
    assert engine_pa.walk_register_cap(engine_pa.WALK_CAP_ABOVE_PROGRAMS_PER_SM * sms, sms) is None
    saved = engine_pa.WALK_MAX_REGISTERS, engine_pa.WALK_CAP_ABOVE_PROGRAMS_PER_SM
    try:
        engine_pa.WALK_MAX_REGISTERS = 0
        assert engine_pa.walk_register_cap(8 * 256, sms) is None
        engine_pa.WALK_MAX_REGISTERS, engine_pa.WALK_CAP_ABOVE_PROGRAMS_PER_SM = 128, 0
        assert engine_pa.walk_register_cap(8 * 256, sms) is None
    finally:
        engine_pa.WALK_MAX_REGISTERS, engine_pa.WALK_CAP_ABOVE_PROGRAMS_PER_SM = saved


def test_the_combine_form_is_a_function_of_the_shape():
    """A decode's combine takes one chunk state an iteration over a short table and 8 over a long one; a verify's 8
    at either; the split keeps a 16-token verify over 8,192 keys at the 8B head shape (68 MB of chunk states),
    which walked under the old 64 MB cap."""
    short, long_ = engine_pa.COMBINE_SHORT_CHUNKS, engine_pa.COMBINE_SHORT_CHUNKS + 1
    assert engine_pa.combine_form(1, short) == (1, 4) and engine_pa.combine_form(1, long_) == (8, 1)
    assert engine_pa.combine_form(16, short) == (8, 2) and engine_pa.combine_form(2, long_) == (8, 4)
    with engine_pa.forced_combine(4, 16, 3, 1):
        assert engine_pa.COMBINE_ROWS == 4 and engine_pa.COMBINE_DIMS == 16
        assert {engine_pa.combine_form(t, n) for t in (1, 16) for n in (1, 1000)} == {(3, 1)}
    assert engine_pa.combine_form(1, long_) == (8, 1) and engine_pa.COMBINE_DIMS == 32  # restored
    chunks = 8192 // engine_pa.KEYS_PER_CHUNK
    verify_8k = chunks * 8 * 1 * 64 * (128 + 2) * 4
    assert verify_8k > 64 << 20
    if torch.cuda.is_available():  # pragma: no cover (GPU machines)
        assert engine_pa.use_split(torch.device("cuda"), 4 * 8, verify_8k, chunks)
    assert verify_8k <= engine_pa.WORKSPACE_MAX_BYTES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="triton compiles on a GPU only (the interpreter never does)")
def test_a_new_table_width_compiles_nothing():  # pragma: no cover (GPU machines)
    """The block table's width and the key and chunk counts are not specialized: a table of 16 blocks (divisible
    by 16) after one of 4 reuses the kernels compiled for the first, walking and split (in a service a table
    bucket first met under load compiled inside the requests in flight)."""
    from flashpd.engine.jit_watch import compiled_variants, engine_kernels
    # the module's @triton.jit helpers (_dot, _merge, ...) are JIT functions too; inlined, they never compile alone
    kernels = {k: v for k, v in engine_kernels().items() if k.startswith("paged_attention.")}
    assert {"paged_attention._attn_kernel", "paged_attention._combine_kernel"} <= set(kernels)
    for split in (False, True):
        q, k, v, bt, pos = random_case(engine_pa, "cuda", torch.bfloat16, 5, 1, 4, seed=1)
        engine_pa.launch(q, k, v, bt, pos, SCALE, split)
        before = compiled_variants(kernels)
        assert before["paged_attention._attn_kernel"] >= 1, before  # the watch reads this Triton's caches
        q, k, v, bt, pos = random_case(engine_pa, "cuda", torch.bfloat16, 5, 1, 16, seed=2)
        engine_pa.launch(q, k, v, bt, pos, SCALE, split)
        assert compiled_variants(kernels) == before, split

"""Paged decode/verify attention in Triton: queries read K/V straight from the paged cache.

The plain-PyTorch path (attention.gather_kv + grouped_attention) copies every row's whole padded KV into a
new tensor and reads a materialized mask, tripling a decode step's KV traffic. Here each program holds a
tile of BLOCK_M query rows of one (kv head, sequence) and walks that sequence's keys BLOCK_N at a time
through its block table, with an fp32 online softmax.

Batch invariance (a position's output must not depend on what shares its forward): the tile sizes are
constants; every tile walks key blocks in increasing order from key 0 with fixed block
boundaries; a key block with none of a row's visible keys leaves that row's state bitwise unchanged (its
running max stays, so alpha = 2^0 = 1 and every p = 0; K/V past the tile's last position are masked loads,
those before it are written K/V, so 0 * v adds exact zeros; the output adds 0.0 so that an exact zero has one
sign); and tl.dot computes each output row from that row alone, in the same order wherever it sits in the
tile. The warp count is free (a call may take its own): a row's sum of weights is an MMA against ones, not a
cross-thread reduction (whose order follows the warps' layout), and the row max is exact in any order, so no
step's arithmetic depends on how the tile is spread over warps (`check_against_reference` tests 1, 2 and 4).

Key chunks, so that how the keys are spread over programs never changes a bit: a row's keys fall into fixed
chunks of KEYS_PER_CHUNK. Each chunk's softmax state (max, sum, weighted values) starts from nothing, and the
row's state is the chunks' states merged one by one in chunk order (`_merge`, explicit FMAs: no contraction
left to the compiler). One program can walk all of a row's chunks and merge them as it goes (`split` off:
many rows, enough programs to fill the GPU), or each chunk can run in its own program and a second kernel
merge their states in the same order with the same `_merge` (`split` on: few rows, a decode at batch 1 or a
verify, where one program per row and KV head would leave most SMs idle). Merging a chunk into an empty state
copies it exactly, so both give the same bits, and the choice is made per call from the shape alone.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, NamedTuple

import torch

from flashpd.engine import triton_env
from flashpd.engine.triton_env import INTERPRET, tl, triton  # triton None: the plain-PyTorch attention only
if triton is not None:
    from flashpd.engine.qkv_rope import norm_rope
    from flashpd.engine.triton_env import pdl_enter

LOG2E = 1.4426950408889634  # scores are kept in the log2 domain: exp2 is the hardware's exponential

# Fixed tile sizes: changing BLOCK_M, BLOCK_N or KEYS_PER_CHUNK changes results (bitwise), never their dependence on
# the batch; the stages and warps change no bit.
# BLOCK_M = 16 rows, the smallest tile tl.dot takes: a decode's G rows (4 at Qwen3's GQA) fill a quarter of it;
# a 64-row tile would idle 60 MMA rows and hold registers that limit how many programs share an SM. A verify of
# 16 tokens x 4 groups takes 4 tiles, each reading the keys again (from L2, mostly). One tile size for every
# width keeps a row's bits the same alone and inside a verify: on an H200 a 16-row and a 64-row tile (different
# MMA instructions) round the same row differently (`check_against_reference` tests this).
# The constants were picked by bench/paged_split.py's sweep at the Qwen3-8B head shape (docs/results.md).
BLOCK_M = 16  # query rows per program
BLOCK_N = 32  # keys per iteration
KEYS_PER_CHUNK = 32  # keys per chunk state (see the module's docstring); a multiple of BLOCK_N
NUM_STAGES = 4
# Warps (no bit depends on them): 2 for a program walking a row's chunks (batches: more programs an SM, and the
# online softmax's row max crosses fewer warps), 4 for a program per chunk (a decode at batch 1, a verify: few
# programs, each wants its chunk's loads spread wide) and for the combine kernel (docs/results.md).
NUM_WARPS = 2
SPLIT_NUM_WARPS = 4
# A register cap for walking programs when there are more of them than fit the GPU at once uncapped
# (WALK_CAP_ABOVE_PROGRAMS_PER_SM an SM; 0: never). ptxas gives a walking program 188 registers at sm_90, so 5
# share an SM; capped at 128 it compiles without spills and 8 do. On an H200 the cap cost 2% at batch 32 and 64
# (256 and 512 programs: one wave either way) and saved 2.5% of the attention at 128 (1,024 programs) and 1.3% of
# the step at 256 (docs/results.md). No bit depends on it: the arithmetic is the same, only registers change.
WALK_MAX_REGISTERS = 128
WALK_CAP_ABOVE_PROGRAMS_PER_SM = 5
# split (a program per key chunk) when one program per (row tile, KV head, sequence) would give fewer programs
# than this per SM, and the chunk states fit WORKSPACE_MAX_BYTES (256 MB: room for a 16-token verify over a table
# of 8,192 keys at the Qwen3-8B head shape, which walks at less and is then over twice as slow; docs/results.md)
SPLIT_BELOW_PROGRAMS_PER_SM = 1
WORKSPACE_MAX_BYTES = 256 << 20
# The combine kernel's form (no bit depends on it: a row's merge is elementwise and in chunk order, whatever the
# program's tile). A program merges at most COMBINE_ROWS rows (a call's rows rounded up to a power of two below
# that: a decode's 4 rows take a 4-row tile, not a 16-row one of 12 idle rows) over COMBINE_DIMS of the head's
# columns (each column slice of a row recomputes the row's max and sum, the same way), with UNROLL chunk states
# an iteration: the merge loop is a chain of dependent steps, so what bounds it is how many chunk states are in
# flight at once. (unroll, warps) by (one token a row, table of at most COMBINE_SHORT_CHUNKS chunks), from
# a sweep at the Qwen3-8B head shape (docs/results.md).
COMBINE_ROWS = 16
COMBINE_DIMS = 32
COMBINE_SHORT_CHUNKS = 32
COMBINE_FORMS: dict[tuple[bool, bool], tuple[int, int]] = {
    (True, True): (1, 4), (True, False): (8, 1), (False, True): (8, 2), (False, False): (8, 4)}


def combine_form(t: int, n_chunks: int) -> tuple[int, int]:
    """(chunk states an iteration, warps) of the combine kernel for a call of t tokens a row over a table of
    n_chunks key chunks: a function of the shape alone (CUDA graphs and compiled callers fix it)."""
    return COMBINE_FORMS[(t == 1, n_chunks <= COMBINE_SHORT_CHUNKS)]


@contextlib.contextmanager
def forced_combine(rows: int, dims: int, unroll: int, warps: int) -> Iterator[None]:
    """Every call's combine kernel in one form while inside (self-checks and tests: no bit may depend on it)."""
    global COMBINE_ROWS, COMBINE_DIMS, COMBINE_FORMS
    saved = COMBINE_ROWS, COMBINE_DIMS, COMBINE_FORMS
    COMBINE_ROWS, COMBINE_DIMS = rows, dims
    COMBINE_FORMS = {key: (unroll, warps) for key in saved[2]}
    try:
        yield
    finally:
        COMBINE_ROWS, COMBINE_DIMS, COMBINE_FORMS = saved


def available() -> bool:
    return triton is not None


class RopeInputs(NamedTuple):
    """What engine/qkv_rope.py's kernel takes besides the QKV rows and the cache (`paged_attention_rope`)."""
    cos: torch.Tensor
    sin: torch.Tensor
    w_qn: torch.Tensor
    w_kn: torch.Tensor
    eps: float
    n_q: int
    slots: torch.Tensor  # [B*T]: where each token's key and value go
    write_pos: torch.Tensor  # [B, T] contiguous: the key index of each token's slot in its row's block table


if triton is not None:
    @triton.jit
    def _dot(a, b, acc, F32: tl.constexpr, ROWWISE: tl.constexpr):
        """acc + a @ b. F32: in fp32 (fp32 inputs: no tf32). ROWWISE (the interpreter only): a broadcast
        product summed in key order, because the interpreter's dot is numpy's matmul, whose BLAS rounds a row
        differently by its place in the tile (a GPU's MMA does not), and multiplies bf16 operands as their raw
        16-bit integers (triton 3.7-3.9); bf16 products are exact in fp32."""
        if ROWWISE:
            return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        elif F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _row_sum(p, F32: tl.constexpr, ROWWISE: tl.constexpr):
        """Each row of p [BM, BN] summed by an MMA against ones (every column of the product is the row's sum;
        their max is it, exactly), so that the order of the additions is the MMA's, whatever the warps: a
        tl.sum reduces across threads and warps in an order that follows their layout (the module's
        docstring). p is what the values' MMA takes, so the weights' sum is of the same weights."""
        ones = tl.full([p.shape[1], 16], 1.0, tl.float32).to(p.dtype)  # (the interpreter has no bf16 full)
        return tl.max(_dot(p, ones, tl.zeros([p.shape[0], 16], tl.float32), F32, ROWWISE), 1)

    @triton.jit
    def _merge(m_run, l_run, acc_run, m_c, l_c, acc_c):
        """A row state merged with the next chunk's (log-sum-exp). A chunk with none of a row's keys (m -inf,
        l 0, acc 0) leaves it as it was; an empty state takes the chunk's exactly (weights 2^0 = 1 and 0)."""
        m_new = tl.maximum(m_run, m_c)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m_run - m_sub)
        b = tl.exp2(m_c - m_sub)
        l_new = tl.fma(l_run, a, l_c * b)
        acc_new = tl.fma(acc_run, a[:, None], acc_c * b[:, None])
        return m_new, l_new, acc_new

    @triton.jit
    def _block(q, k_base, v_base, bt_row, pos, max_pos, n_keys, start, m_i, l_i, acc, qk_scale,
               sk_blk, sk_off, sv_blk, sv_off, d_ok, PAGE: tl.constexpr, BN: tl.constexpr, F32: tl.constexpr,
               INTERPRET: tl.constexpr):
        """A chunk's state after its next BN keys from `start` (the online softmax in the log2 domain)."""
        keys = start + tl.arange(0, BN)
        k_ok = (keys <= max_pos) & (keys < n_keys)
        page = tl.load(bt_row + keys // PAGE, mask=k_ok, other=0)
        off = keys % PAGE
        ld = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + page[:, None] * sk_blk + off[:, None] * sk_off, mask=ld, other=0.0)
        v = tl.load(v_base + page[:, None] * sv_blk + off[:, None] * sv_off, mask=ld, other=0.0)
        s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], BN], tl.float32), F32, INTERPRET)
        s = tl.where(keys[None, :] <= pos[:, None], s * qk_scale, float("-inf"))
        # a row that sees no key of this block keeps m (alpha = 2^0 = 1, p = 0): its l and acc stay
        # bitwise as they were; m_sub = 0 for a row that has seen no key yet (no -inf - -inf)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None]).to(v.dtype)
        l_i = l_i * alpha + _row_sum(p, F32, INTERPRET)
        acc = _dot(p, v, acc * alpha[:, None], F32, INTERPRET)
        return m_new, l_i, acc

    # Integers that follow the batch's context rather than its shape class (the block table's width, the
    # positions' row stride, the key count) are not specialized: Triton would compile a variant for each one's
    # "== 1" / divisible-by-16 state, and a table bucket first met while serving (a walking call at a table width
    # the warm-up's short prompts never made) then compiled inside the requests in flight (docs/results.md). They
    # only index gathers and bound loops: no vector access loses its alignment.
    @triton.jit(do_not_specialize=["n_keys", "sbt_b", "spos_b"])
    def _attn_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                     qk_scale, HKV, M, n_keys,
                     sq_h, sq_b, sq_m, so_h, so_b, so_t, so_g,
                     sk_blk, sk_off, sk_h, sv_blk, sv_off, sv_h, sbt_b, spos_b,
                     cos_ptr, sin_ptr, wq_ptr, wk_ptr, slot_ptr, wpos_ptr, eps, s_cs_b, s_cs_t,
                     G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, KPC: tl.constexpr, SPLIT: tl.constexpr,
                     F32: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
                     ROPE: tl.constexpr, NQ: tl.constexpr, T_PAD: tl.constexpr, DT: tl.constexpr):
        """One (row tile, kv head * batch, key chunk) program. SPLIT: write the state of the keys of chunk
        `program_id(2)` for `_combine_kernel`; else walk every chunk, merge, and write the output. PDL: see
        triton_env.pdl.

        ROPE: q_ptr is the QKV matmul's output [B, T, (NQ + 2 HKV) D] (sq_b, sq_m its batch and token strides),
        and the program does engine/qkv_rope.py's work for what it reads: its rows' queries (qkv_rope.norm_rope,
        rounded to DT as that kernel stores them), and the key (normed, roped) and value of every token of its
        sequence whose key index (wpos_ptr [B, T]) lies in the keys it reads, written at the token's slot
        (slot_ptr [B*T]) before the barrier after which it reads the cache. A token's key is read only by the
        programs whose keys hold its index, each of which writes it first (the same bits each time)."""
        pdl_enter(PDL)
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)
        # a sequence's KV heads are neighbouring programs: its heads' keys share each cache page (the layout
        # is [blocks, bs, Hkv, d]), which programs running side by side then read together
        b = pid_bh // HKV
        h = pid_bh % HKV
        rows = pid_m * BM + tl.arange(0, BM)
        row_ok = rows < M
        pos = tl.load(pos_ptr + b * spos_b + rows // G, mask=row_ok, other=-1)
        max_pos = tl.max(pos, 0)
        if SPLIT:
            # a chunk past the tile's last position (a table wider than the context): nothing to write, and the
            # combine kernel never reads it
            if pid_s * KPC > max_pos:
                return
        dd = tl.arange(0, D_PAD)
        d_ok = dd < D
        if SPLIT:
            lo = pid_s * KPC
            hi = tl.minimum(tl.minimum(max_pos + 1, n_keys), lo + KPC)
        else:
            lo = 0
            hi = tl.minimum(max_pos + 1, n_keys)
        if ROPE:  # (D == D_PAD: qkv_rope.applies takes power-of-two head dims only)
            T = M // G
            tt = tl.arange(0, T_PAD)
            p_new = tl.load(wpos_ptr + b * T + tt, mask=tt < T, other=-1)  # the keys these tokens become
            mine = (tt < T) & (p_new >= lo) & (p_new < hi)
            if tl.max(mine.to(tl.int32), 0) > 0:  # most chunk programs hold none of the call's tokens
                k_new = norm_rope(q_ptr + b * sq_b + tt * sq_m + (NQ + h) * D, b * s_cs_b + tt * s_cs_t,
                                  cos_ptr, sin_ptr, wk_ptr, eps, mine, D, DT)
                v_new = tl.load(q_ptr + b * sq_b + tt[:, None] * sq_m + (NQ + HKV + h) * D + dd[None, :],
                                mask=mine[:, None], other=0.0)
                slot = tl.load(slot_ptr + b * T + tt, mask=mine, other=0)
                blk, off = slot // PAGE, slot % PAGE
                tl.store(k_ptr + (blk * sk_blk + off * sk_off + h * sk_h)[:, None] + dd[None, :],
                         k_new.to(k_ptr.dtype.element_ty), mask=mine[:, None])
                tl.store(v_ptr + (blk * sv_blk + off * sv_off + h * sv_h)[:, None] + dd[None, :],
                         v_new.to(v_ptr.dtype.element_ty), mask=mine[:, None])
                tl.debug_barrier()  # the writes above, before any thread of the program reads the cache
            # the queries after the branch: in the block of the key loads that follow, whose latency theirs can hide
            tok = rows // G
            q = norm_rope(q_ptr + b * sq_b + tok * sq_m + (h * G + rows % G) * D, b * s_cs_b + tok * s_cs_t,
                          cos_ptr, sin_ptr, wq_ptr, eps, row_ok, D, DT).to(DT)
        else:
            q = tl.load(q_ptr + h * sq_h + b * sq_b + rows[:, None] * sq_m + dd[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # the row's state: its chunks' states merged in order
        m_run = tl.full([BM], float("-inf"), tl.float32)
        l_run = tl.zeros([BM], tl.float32)
        acc_run = tl.zeros([BM, D_PAD], tl.float32)
        qk_scale = tl.cast(qk_scale, tl.float32)  # a compiled caller passes the float as fp64
        k_base = k_ptr + h * sk_h + dd[None, :]
        v_base = v_ptr + h * sv_h + dd[None, :]
        for c_lo in range(lo, hi, KPC):
            # one chunk from nothing, its blocks unrolled (the pipelined loop is the chunk loop); a block past the
            # tile's last key loads nothing and changes nothing
            m_i = tl.full([BM], float("-inf"), tl.float32)
            l_i = tl.zeros([BM], tl.float32)
            acc = tl.zeros([BM, D_PAD], tl.float32)
            for j in tl.static_range(0, KPC, BN):
                m_i, l_i, acc = _block(q, k_base, v_base, bt_ptr + b * sbt_b, pos, max_pos, n_keys, c_lo + j,
                                       m_i, l_i, acc, qk_scale, sk_blk, sk_off, sv_blk, sv_off, d_ok,
                                       PAGE, BN, F32, INTERPRET)
            m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m_i, l_i, acc)
        if SPLIT:
            ws = (pid_s * tl.num_programs(1) + pid_bh) * M + rows
            keep = row_ok & (lo <= max_pos)  # a chunk past the tile's keys: no row reads it
            tl.store(m_ptr + ws, m_run, mask=keep)
            tl.store(l_ptr + ws, l_run, mask=keep)
            tl.store(acc_ptr + ws[:, None] * D_PAD + dd[None, :], acc_run, mask=keep[:, None])
        else:
            out = acc_run / tl.where(l_run > 0, l_run, 1.0)[:, None] + 0.0  # + 0.0: one sign for an exact zero
            o_rows = (rows // G) * so_t + (rows % G) * so_g  # row t*G + j: token t, query group j
            tl.store(out_ptr + h * so_h + b * so_b + o_rows[:, None] + dd[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit(do_not_specialize=["n_chunks", "spos_b"])  # as _attn_kernel's: they follow the context
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, pos_ptr, out_ptr, HKV, M, n_chunks, spos_b, so_h, so_b, so_t, so_g,
                        G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BM: tl.constexpr, DC: tl.constexpr,
                        KPC: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
        """Merge a row's chunk states in chunk order with `_merge`, as the unsplit kernel does; chunks past
        its position are skipped (merging one would change nothing). A program takes BM rows and DC of the
        D_PAD columns (program_id 2); every column slice of a row computes the row's max and sum the same way.
        UNROLL chunks an iteration, unrolled, so that their loads need not wait for one another's merge (the loop
        is not pipelined: its loads feed no dot); a chunk past the tile's last one, in the unrolled tail, is off
        for every row."""
        pdl_enter(PDL)
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // HKV
        h = pid_bh % HKV
        rows = pid_m * BM + tl.arange(0, BM)
        row_ok = rows < M
        pos = tl.load(pos_ptr + b * spos_b + rows // G, mask=row_ok, other=-1)
        dd = tl.program_id(2) * DC + tl.arange(0, DC)
        bh = tl.num_programs(1)
        m_run = tl.full([BM], float("-inf"), tl.float32)
        l_run = tl.zeros([BM], tl.float32)
        acc_run = tl.zeros([BM, DC], tl.float32)
        # chunks past the tile's last position hold no key of its rows: not read (a table wider than the context,
        # as a reserved or bucketed one is, costs no loop iteration)
        last = tl.minimum(n_chunks, tl.max(pos, 0) // KPC + 1)
        for c0 in range(0, last, UNROLL):
            for u in tl.static_range(UNROLL):
                c = c0 + u
                on = row_ok & (c * KPC <= pos)
                ws = (c * bh + pid_bh) * M + rows
                m_c = tl.load(m_ptr + ws, mask=on, other=float("-inf"))
                l_c = tl.load(l_ptr + ws, mask=on, other=0.0)
                acc_c = tl.load(acc_ptr + ws[:, None] * D_PAD + dd[None, :], mask=on[:, None], other=0.0)
                m_mg, l_mg, acc_mg = _merge(m_run, l_run, acc_run, m_c, l_c, acc_c)
                m_run = tl.where(on, m_mg, m_run)
                l_run = tl.where(on, l_mg, l_run)
                acc_run = tl.where(on[:, None], acc_mg, acc_run)
        out = acc_run / tl.where(l_run > 0, l_run, 1.0)[:, None] + 0.0
        o_rows = (rows // G) * so_t + (rows % G) * so_g
        tl.store(out_ptr + h * so_h + b * so_b + o_rows[:, None] + dd[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dd < D)[None, :])

    def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               positions: torch.Tensor, scale: float, split: bool | None = None, block_m: int = BLOCK_M,
               block_n: int = BLOCK_N, num_warps: int | None = None, num_stages: int = NUM_STAGES,
               heads_last: bool = False, keys_per_chunk: int = KEYS_PER_CHUNK, rope: "RopeInputs | None" = None
               ) -> torch.Tensor:
        """The two kernels' launch. split: a program per key chunk and the combine kernel (None: `use_split`
        decides); the same bits either way. The tile and chunk arguments exist for bench/paged_split's sweep
        (they change bits); the op passes the module's constants. num_warps: the walking or chunk programs'
        (None: NUM_WARPS, or SPLIT_NUM_WARPS for a program per chunk; no bit depends on it); the combine kernel's
        come from `combine_form`. heads_last: the output as [B, T, Hq*d] (o_proj's input), else like q.
        rope: q is the QKV matmul's output [B, T, (Hq + 2 Hkv) d], and the kernel makes the queries and writes
        the call's keys and values itself (`paged_attention_rope`)."""
        t = positions.shape[1]
        if rope is None:
            hkv, b, m, d = q.shape
            q_strides = (q.stride(0), q.stride(1), q.stride(2))
            rope_args = (q, q, q, q, q, q, 0.0, 0, 0)  # unread
            rope_kw = {"ROPE": False, "NQ": 0, "T_PAD": 1, "DT": _TL_DTYPES[q.dtype]}
        else:
            hkv, d = k_cache.shape[2], k_cache.shape[3]
            b = q.shape[0]
            n_q = rope.n_q
            m = t * (n_q // hkv)
            q_strides = (0, q.stride(0), q.stride(1))  # ROPE: batch and token strides
            assert rope.write_pos.shape == positions.shape and rope.write_pos.is_contiguous()
            rope_args = (rope.cos, rope.sin, rope.w_qn, rope.w_kn, rope.slots, rope.write_pos, float(rope.eps),
                         rope.cos.stride(0), rope.cos.stride(1))
            rope_kw = {"ROPE": True, "NQ": n_q, "T_PAD": triton.next_power_of_2(t), "DT": _TL_DTYPES[q.dtype]}
        assert positions.stride(1) == 1 or t == 1, "positions: each row's must be consecutive"
        assert keys_per_chunk % block_n == 0
        g = m // t
        page = k_cache.shape[1]
        n_keys = block_tables.shape[1] * page
        d_pad = max(16, triton.next_power_of_2(d))
        f32 = q.dtype == torch.float32
        if heads_last:  # row t*G + j of head h at [b, t, (h*G + j)*d]
            out = torch.empty((b, t, hkv * g * d), dtype=q.dtype, device=q.device)
            so = (g * d, out.stride(0), out.stride(1), d)
        else:
            out = torch.empty((hkv, b, m, d), dtype=q.dtype, device=q.device)
            so = (out.stride(0), out.stride(1), g * out.stride(2), out.stride(2))
        tiles = triton.cdiv(m, block_m)
        n_chunks = triton.cdiv(n_keys, keys_per_chunk)
        if split is None:
            split = use_split(q.device, tiles * hkv * b, n_chunks * hkv * b * m * (d_pad + 2) * 4, n_chunks)
        if num_warps is None:
            num_warps = SPLIT_NUM_WARPS if split else NUM_WARPS
        cap = None if split or INTERPRET else walk_register_cap(tiles * hkv * b, _sm_count(q.device))
        options = {"maxnreg": cap} if cap else {}
        if split:
            m_ws = torch.empty((n_chunks, hkv * b, m), dtype=torch.float32, device=q.device)
            l_ws = torch.empty_like(m_ws)
            acc_ws = torch.empty((n_chunks, hkv * b, m, d_pad), dtype=torch.float32, device=q.device)
        else:
            m_ws = l_ws = acc_ws = torch.empty(1, dtype=torch.float32, device=q.device)  # unused (no alias of out)
        _attn_kernel[(tiles, hkv * b, n_chunks if split else 1)](
            q, k_cache, v_cache, block_tables, positions, out, m_ws, l_ws, acc_ws,
            scale * LOG2E, hkv, m, n_keys,
            *q_strides, *so,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), positions.stride(0), *rope_args,
            G=g, PAGE=page, D=d, D_PAD=d_pad, BM=block_m, BN=block_n, KPC=keys_per_chunk, SPLIT=bool(split),
            F32=f32, INTERPRET=INTERPRET, num_warps=num_warps, num_stages=num_stages, **options, **rope_kw,
            **triton_env.pdl_args(q.device, next_latency=bool(split), tokens=t, rows=b * t))  # split: a combine next
        if split:
            rows_c = min(COMBINE_ROWS, triton.next_power_of_2(m))
            dims_c = min(COMBINE_DIMS, d_pad)
            unroll, warps = combine_form(t, n_chunks)
            _combine_kernel[(triton.cdiv(m, rows_c), hkv * b, d_pad // dims_c)](
                m_ws, l_ws, acc_ws, positions, out, hkv, m, n_chunks, positions.stride(0), *so,
                G=g, D=d, D_PAD=d_pad, BM=rows_c, DC=dims_c, KPC=keys_per_chunk, UNROLL=unroll,
                num_warps=warps, **triton_env.pdl_args(q.device))
        return out

    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @torch.library.custom_op("flashpd::paged_attention_rope", mutates_args=("k_cache", "v_cache"))
    def _paged_attention_rope_op(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, positions: torch.Tensor, scale: float,
                                 cos: torch.Tensor, sin: torch.Tensor, w_qn: torch.Tensor, w_kn: torch.Tensor,
                                 eps: float, n_q: int, slots: torch.Tensor, write_pos: torch.Tensor,
                                 heads_last: bool) -> torch.Tensor:
        return launch(qkv, k_cache, v_cache, block_tables, positions, scale, None, BLOCK_M, BLOCK_N, None,
                      NUM_STAGES, heads_last, KEYS_PER_CHUNK,
                      RopeInputs(cos, sin, w_qn, w_kn, eps, n_q, slots, write_pos))

    @_paged_attention_rope_op.register_fake
    def _(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          positions: torch.Tensor, scale: float, cos: torch.Tensor, sin: torch.Tensor, w_qn: torch.Tensor,
          w_kn: torch.Tensor, eps: float, n_q: int, slots: torch.Tensor, write_pos: torch.Tensor,
          heads_last: bool) -> torch.Tensor:
        b, t, _ = qkv.shape
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        return qkv.new_empty((b, t, n_q * d)) if heads_last else qkv.new_empty((hkv, b, t * (n_q // hkv), d))

    # An opaque custom op, not a torch.library.triton_op: compiled, inductor then calls it as one extern
    # kernel instead of tracing into its launches, whose buffers (the output, the split's workspaces) its
    # scheduler mis-ordered for a verify-width decode on torch 2.11 (KeyError in compute_ancestors, H200).
    # Nothing around the kernel fused with it anyway.
    @torch.library.custom_op("flashpd::paged_attention", mutates_args=())
    def _paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, positions: torch.Tensor, scale: float,
                            split: int, heads_last: bool) -> torch.Tensor:
        # the constants are read here, at call time (bench/paged_check.py's sweep sets them)
        return launch(q, k_cache, v_cache, block_tables, positions, scale, None if split < 0 else bool(split),
                      BLOCK_M, BLOCK_N, None, NUM_STAGES, heads_last, KEYS_PER_CHUNK)

    @_paged_attention_op.register_fake
    def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          positions: torch.Tensor, scale: float, split: int, heads_last: bool) -> torch.Tensor:
        hkv, b, m, d = q.shape
        t = positions.shape[1]
        return q.new_empty((b, t, hkv * (m // t) * d)) if heads_last else torch.empty_like(q)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def walk_register_cap(programs: int, sm_count: int) -> int | None:
    """The register cap (triton's maxnreg) for a call of `programs` walking programs on `sm_count` SMs:
    WALK_MAX_REGISTERS past WALK_CAP_ABOVE_PROGRAMS_PER_SM programs an SM, else None (ptxas's allocation)."""
    if WALK_MAX_REGISTERS and WALK_CAP_ABOVE_PROGRAMS_PER_SM and programs > WALK_CAP_ABOVE_PROGRAMS_PER_SM * sm_count:
        return WALK_MAX_REGISTERS
    return None


def use_split(device: torch.device, programs: int, workspace_bytes: int, n_chunks: int) -> bool:
    """Whether a call runs a program per key chunk: when one program per (row tile, KV head, sequence) would
    leave SMs idle (SPLIT_BELOW_PROGRAMS_PER_SM), the keys span more than one chunk, and the chunk states fit
    WORKSPACE_MAX_BYTES. Speed only: the bits are the same either way (the module's docstring)."""
    return (n_chunks > 1 and programs < SPLIT_BELOW_PROGRAMS_PER_SM * _sm_count(device)
            and workspace_bytes <= WORKSPACE_MAX_BYTES)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    positions: torch.Tensor, scale: float, heads_last: bool = False,
                    split: bool | None = None) -> torch.Tensor:
    """q [Hkv, B, T*G, d] (attention.group_queries), k/v_cache [blocks, bs, Hkv, d], block_tables [B, nblk],
    positions [B, T] -> [Hkv, B, T*G, d] like q, or with heads_last [B, T, Hq*d] in o_proj's column order
    (query head h*G + j; attention.heads_last's layout, written by the kernel: no copy). Row t*G + j of (head,
    b) attends to keys 0..positions[b, t] (key i in block block_tables[b, i // bs] at offset i % bs).
    split: None lets `use_split` choose by shape (the engine); True or False forces it (tests: the same bits)."""
    if triton is None:
        raise RuntimeError("paged_attention needs triton")
    assert q.shape[2] % positions.shape[1] == 0
    assert q.stride(3) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    # the kernel reads a row's positions as consecutive elements; a native decode at a verify's width passes
    # one position expanded (stride 0), which compiled must be a buffer of its own, not a view, for inductor
    positions = positions.contiguous()
    return torch.ops.flashpd.paged_attention(q, k_cache, v_cache, block_tables, positions, float(scale),
                                             -1 if split is None else int(split), heads_last)


def paged_attention_rope(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, positions: torch.Tensor, scale: float, cos: torch.Tensor,
                         sin: torch.Tensor, w_qn: torch.Tensor, w_kn: torch.Tensor, eps: float, n_q: int,
                         slots: torch.Tensor, write_positions: torch.Tensor | None = None,
                         heads_last: bool = False) -> torch.Tensor:
    """engine/qkv_rope.qkv_rope_write and `paged_attention` as one launch: qkv [B, T, (n_q + 2 Hkv) d] (the QKV
    matmul's output), cos/sin [B, T, d], the norms' weights [d], slots [B*T] -> what `paged_attention` returns for
    qkv_rope_write's queries, with each token's key and value written at its slot as qkv_rope_write writes them
    (the same bits, with qkv_rope.IN_ATTENTION on: both kernels then take qkv_rope.norm_rope).

    positions bound each query's keys, as `paged_attention`'s do; write_positions [B, T] (default: positions) is
    the key index each token's slot holds in its row's table (the drafter's block queries all see to the block's
    last position, while its tokens' keys sit at their own). A program writes the tokens whose key index lies in
    the keys it reads, then reads: so every token's key index must be at most its row's last query bound (it is,
    in every call of the engine), or its key is never written. Where qkv_rope.applies and the cache is
    [blocks, bs, Hkv, d]; a block the call writes must be in no other row's table (the engine's: a sequence writes
    only blocks it alone holds). Why one launch: a decode step at batch 1 is latency-bound between its
    projections (docs/architecture.md)."""
    if triton is None:
        raise RuntimeError("paged_attention_rope needs triton")
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    assert qkv.dim() == 3 and qkv.shape[-1] == (n_q + 2 * hkv) * d and qkv.stride(-1) == 1
    assert qkv.shape[:2] == positions.shape and slots.numel() == positions.numel() and slots.is_contiguous()
    assert cos.shape == sin.shape == (*qkv.shape[:2], d) and cos.stride() == sin.stride() and cos.stride(-1) == 1
    assert w_qn.is_contiguous() and w_kn.is_contiguous() and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert d & (d - 1) == 0 and n_q % hkv == 0
    positions = positions.contiguous()
    write_positions = positions if write_positions is None else write_positions.contiguous()
    assert write_positions.shape == positions.shape
    return torch.ops.flashpd.paged_attention_rope(qkv, k_cache, v_cache, block_tables, positions, float(scale), cos,
                                                  sin, w_qn, w_kn, float(eps), n_q, slots, write_positions,
                                                  heads_last)


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The plain-PyTorch path the kernel replaces: gather_kv + the position mask + grouped_attention."""
    from flashpd.engine.attention import causal_position_mask, gather_kv, group_mask, grouped_attention
    mask = group_mask(causal_position_mask(positions, block_tables.shape[1] * k_cache.shape[1]),
                      q.shape[2] // positions.shape[1])
    return grouped_attention(q, gather_kv(k_cache, block_tables), gather_kv(v_cache, block_tables), mask, scale)


def random_case(b: int, t: int, hkv: int, groups: int, d: int, kv_block_size: int, nblk: int, num_blocks: int,
                dtype: torch.dtype, device: torch.device | str, seed: int = 0, min_pos: int = 0
                ) -> tuple[torch.Tensor, ...]:
    """Random q, caches, block tables (distinct blocks >= 1 per row, the tail padded with the scratch block 0)
    and positions [B, T] (consecutive from a random start, so every row fits its blocks)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv, b, t * groups, d, generator=g).to(dtype)
    k = torch.randn(num_blocks, kv_block_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, kv_block_size, hkv, d, generator=g).to(dtype)
    tables = torch.zeros(b, nblk, dtype=torch.int64)
    pos = torch.zeros(b, t, dtype=torch.int64)
    for i in range(b):
        end = int(torch.randint(max(t, min_pos + t), nblk * kv_block_size + 1, (1,), generator=g))  # positions < end
        used = -(-end // kv_block_size)
        tables[i, :used] = torch.randperm(num_blocks - 1, generator=g)[:used] + 1
        pos[i] = torch.arange(end - t, end)
    return tuple(x.to(device) for x in (q, k, v, tables, pos))


def check_against_reference(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16
                            ) -> dict[str, float | bool]:
    """GPU self-check at Qwen3-8B's head shape: max abs error against `reference` (decode and verify over one
    and over several key chunks, each with and without a program per chunk), and whether a row's output is
    bitwise the same alone (T=1, B=1), inside a verify of 16, inside a bigger batch with a wider table, with and
    without a program per chunk (its combine kernel at 1, 3 and the module's chunk states an iteration), at
    1, 2 and 4 warps, under register caps (WALK_MAX_REGISTERS), and written in o_proj's layout (heads_last)."""
    scale = 128 ** -0.5
    errs = []
    for b, t, nblk, seed in ((8, 1, 4, 0), (4, 16, 4, 1), (3, 1, 70, 2), (2, 16, 70, 3)):
        q, k, v, bt, pos = random_case(b, t, 8, 4, 128, 16, nblk, 300, dtype, device, seed)
        ref = reference(q.float(), k.float(), v.float(), bt, pos, scale)
        for split in (False, True):
            errs.append((paged_attention(q, k, v, bt, pos, scale, split=split).float() - ref).abs().max().item())
    invariant = True
    for nblk in (4, 70):  # one chunk, many
        q, k, v, bt, pos = random_case(6, 16, 8, 4, 128, 16, nblk, 600, dtype, device, seed=nblk)
        full = paged_attention(q, k, v, bt, pos, scale, split=False)
        wide = torch.cat([bt, torch.zeros_like(bt)], dim=1)
        for split in (False, True):
            invariant &= torch.equal(paged_attention(q, k, v, bt, pos, scale, split=split), full)
            for row, col in ((0, 0), (2, 7), (5, 15)):
                alone = paged_attention(q[:, row:row + 1, col * 4:col * 4 + 4].contiguous(), k, v,
                                        bt[row:row + 1], pos[row:row + 1, col:col + 1], scale, split=split)
                big = paged_attention(q, k, v, wide, pos, scale, split=split)[:, row:row + 1, col * 4:col * 4 + 4]
                mine = full[:, row:row + 1, col * 4:col * 4 + 4]
                invariant &= torch.equal(alone, mine) and torch.equal(big, mine)
        last = paged_attention(q, k, v, bt, pos, scale, heads_last=True)  # the engine's layout
        invariant &= torch.equal(last, full.view(8, 6, 16, 4, 128).permute(1, 2, 0, 3, 4).reshape(6, 16, -1))
    # any warp count, walking or a program per chunk (the last case's rows: up to 35 chunks)
    for warps in (1, 2, 4):
        for split in (False, True):
            invariant &= torch.equal(launch(q, k, v, bt, pos, scale, split, num_warps=warps), full)
    global WALK_MAX_REGISTERS, WALK_CAP_ABOVE_PROGRAMS_PER_SM
    # a walking program under register caps, and without one (WALK_MAX_REGISTERS changes no arithmetic)
    saved_cap = WALK_MAX_REGISTERS, WALK_CAP_ABOVE_PROGRAMS_PER_SM
    try:
        WALK_CAP_ABOVE_PROGRAMS_PER_SM = -1  # every walking call takes the cap
        for WALK_MAX_REGISTERS in (0, 128, 96):
            invariant &= torch.equal(launch(q, k, v, bt, pos, scale, False), full)
            invariant &= torch.equal(launch(q, k, v, wide, pos, scale, False, heads_last=True), last)
    finally:
        WALK_MAX_REGISTERS, WALK_CAP_ABOVE_PROGRAMS_PER_SM = saved_cap
    # the combine kernel in other forms (rows a program, columns a program, chunk states an iteration, warps), a
    # verify's call and a decode's
    for form in ((16, 128, 1, 4), (4, 32, 3, 1), (8, 64, 8, 2), (16, 32, 16, 4)):
        with forced_combine(*form):
            invariant &= torch.equal(paged_attention(q, k, v, wide, pos, scale, split=True), full)
            alone = paged_attention(q[:, 5:6, 60:64].contiguous(), k, v, wide[5:6], pos[5:6, 15:16], scale, split=True)
            invariant &= torch.equal(alone, full[:, 5:6, 60:64])
    return {"max_abs_err": max(errs), "invariant": bool(invariant)}

"""Diagnosis, not run yet: the split paged attention without its combine kernel (the last chunk program to finish
merges), against the engine's split kernel plus combine.

At batch 1 the combine kernel is 36 launches a step, 0.154 ms (forms_8bcc2a0/ab*.json's profiles). Here each
chunk program stores its state as the engine's does, then counts itself in with an atomic (acq_rel, after a
barrier, so its stores are visible first); the program that counts last merges every chunk's state in chunk order
with the engine's `_merge`, as `_combine_kernel` does, writes the output, and resets the counter for the next call.
The same arithmetic in the same order, so the script checks the bits against the engine (split and walking)
before it times both at the Qwen3-8B head shape: a decode (1 token, 4 rows a head) and a verify (16 tokens) at
batch 1, and a decode at batch 3, about 280-300 keys, 36 calls a CUDA graph, each on its own cache.

    OUT=. python merge_last.py                 # on a GPU: merge_last.json
    TRITON_INTERPRET=1 python merge_last.py --check   # the bits only, on a CPU (fp32)

Open questions the GPU run answers: whether the merge's loads see the other programs' stores on every run (the
bits check runs each case 20 times), and whether the tail the merge adds to the last program costs less than the
combine launch.
"""
import json
import os
import sys

import torch

from flashpd.bench.gemm_shapes import graph_us
from flashpd.engine import paged_attention as pa
from flashpd.engine.paged_attention import _block, _merge
from flashpd.engine.triton_env import INTERPRET, tl, triton


@triton.jit
def _attn_merge_last(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr,
                     qk_scale, HKV, M, n_keys, n_chunks,
                     sq_h, sq_b, sq_m, so_h, so_b, so_t, so_g,
                     sk_blk, sk_off, sk_h, sv_blk, sv_off, sv_h, sbt_b, spos_b,
                     G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, KPC: tl.constexpr, UNROLL: tl.constexpr,
                     F32: tl.constexpr, INTERPRET: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // HKV
    h = pid_bh % HKV
    bh = tl.num_programs(1)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    pos = tl.load(pos_ptr + b * spos_b + rows // G, mask=row_ok, other=-1)
    max_pos = tl.max(pos, 0)
    if pid_s * KPC > max_pos:
        return
    dd = tl.arange(0, D_PAD)
    d_ok = dd < D
    q = tl.load(q_ptr + h * sq_h + b * sq_b + rows[:, None] * sq_m + dd[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lo = pid_s * KPC
    qk_scale = tl.cast(qk_scale, tl.float32)
    k_base = k_ptr + h * sk_h + dd[None, :]
    v_base = v_ptr + h * sv_h + dd[None, :]
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D_PAD], tl.float32)
    for j in tl.static_range(0, KPC, BN):
        m_i, l_i, acc = _block(q, k_base, v_base, bt_ptr + b * sbt_b, pos, max_pos, n_keys, lo + j, m_i, l_i, acc,
                               qk_scale, sk_blk, sk_off, sv_blk, sv_off, d_ok, PAGE, BN, F32, INTERPRET)
    m_c, l_c, acc_c = _merge(tl.full([BM], float("-inf"), tl.float32), tl.zeros([BM], tl.float32),
                             tl.zeros([BM, D_PAD], tl.float32), m_i, l_i, acc)
    ws = (pid_s * bh + pid_bh) * M + rows
    tl.store(m_ptr + ws, m_c, mask=row_ok)
    tl.store(l_ptr + ws, l_c, mask=row_ok)
    tl.store(acc_ptr + ws[:, None] * D_PAD + dd[None, :], acc_c, mask=row_ok[:, None])
    tl.debug_barrier()  # every thread's stores issued before the count (the release orders them for the GPU)
    last = tl.minimum(n_chunks, max_pos // KPC + 1)
    cnt_at = cnt_ptr + pid_m * bh + pid_bh
    if tl.atomic_add(cnt_at, 1, sem="acq_rel") == last - 1:
        tl.atomic_xchg(cnt_at, 0)  # the next call starts from zero
        m_run = tl.full([BM], float("-inf"), tl.float32)
        l_run = tl.zeros([BM], tl.float32)
        acc_run = tl.zeros([BM, D_PAD], tl.float32)
        for c0 in range(0, last, UNROLL):
            for u in tl.static_range(UNROLL):
                c = c0 + u
                on = row_ok & (c * KPC <= pos)
                wc = (c * bh + pid_bh) * M + rows
                m_s = tl.load(m_ptr + wc, mask=on, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(l_ptr + wc, mask=on, other=0.0, cache_modifier=".cg")
                acc_s = tl.load(acc_ptr + wc[:, None] * D_PAD + dd[None, :], mask=on[:, None], other=0.0,
                                cache_modifier=".cg")
                m_mg, l_mg, acc_mg = _merge(m_run, l_run, acc_run, m_s, l_s, acc_s)
                m_run = tl.where(on, m_mg, m_run)
                l_run = tl.where(on, l_mg, l_run)
                acc_run = tl.where(on[:, None], acc_mg, acc_run)
        out = acc_run / tl.where(l_run > 0, l_run, 1.0)[:, None] + 0.0
        o_rows = (rows // G) * so_t + (rows % G) * so_g
        tl.store(out_ptr + h * so_h + b * so_b + o_rows[:, None] + dd[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           positions: torch.Tensor, scale: float, counters: torch.Tensor) -> torch.Tensor:
    """The engine's split launch (paged_attention.launch, heads_last) with the merge in the last program."""
    hkv, b, m, d = q.shape
    t = positions.shape[1]
    g = m // t
    page = k_cache.shape[1]
    n_keys = block_tables.shape[1] * page
    d_pad = max(16, triton.next_power_of_2(d))
    out = torch.empty((b, t, hkv * g * d), dtype=q.dtype, device=q.device)
    so = (g * d, out.stride(0), out.stride(1), d)
    tiles = triton.cdiv(m, pa.BLOCK_M)
    n_chunks = triton.cdiv(n_keys, pa.KEYS_PER_CHUNK)
    assert counters.numel() >= tiles * hkv * b and counters.dtype == torch.int32
    m_ws = torch.empty((n_chunks, hkv * b, m), dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty((n_chunks, hkv * b, m, d_pad), dtype=torch.float32, device=q.device)
    _attn_merge_last[(tiles, hkv * b, n_chunks)](
        q, k_cache, v_cache, block_tables, positions, out, m_ws, l_ws, acc_ws, counters,
        scale * pa.LOG2E, hkv, m, n_keys, n_chunks,
        q.stride(0), q.stride(1), q.stride(2), *so,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), positions.stride(0),
        G=g, PAGE=page, D=d, D_PAD=d_pad, BM=pa.BLOCK_M, BN=pa.BLOCK_N, KPC=pa.KEYS_PER_CHUNK,
        UNROLL=pa.COMBINE_UNROLL if t > 1 else pa.COMBINE_UNROLL_ONE_TOKEN, F32=q.dtype == torch.float32,
        INTERPRET=INTERPRET, num_warps=pa.SPLIT_NUM_WARPS, num_stages=pa.NUM_STAGES)
    return out


def main() -> None:
    check_only = "--check" in sys.argv
    dev = "cpu" if check_only else "cuda"
    dt = torch.float32 if check_only else torch.bfloat16
    hkv, groups, d, page = (2, 4, 32, 16) if check_only else (8, 4, 128, 16)
    calls, repeats = (1, 2) if check_only else (36, 20)
    scale = d ** -0.5
    res = {}
    for b, t in ((1, 1), (1, 16), (3, 1)):  # a decode and a verify at batch 1, a decode at batch 3
        cases = [pa.random_case(b, t, hkv, groups, d, page, 19, 64 * b * calls + 32, dt, dev, seed=t * 100 + i,
                                min_pos=270) for i in range(calls)]
        counters = torch.zeros(4096, dtype=torch.int32, device=dev)
        same = True
        for _ in range(repeats):
            for q, k, v, bt, pos in cases:
                want = pa.paged_attention(q, k, v, bt, pos, scale, heads_last=True, split=True)
                walk = pa.paged_attention(q, k, v, bt, pos, scale, heads_last=True, split=False)
                got = launch(q, k, v, bt, pos, scale, counters)
                same &= torch.equal(got, want) and torch.equal(got, walk)
        same &= int(counters.abs().sum()) == 0
        res[f"b{b}_t{t}_bits_equal"] = bool(same)
        print(b, t, "bits equal (split, walking), counters back at 0:", same, flush=True)
        if check_only:
            continue
        res[f"b{b}_t{t}_engine_us"] = graph_us([lambda c=c: pa.paged_attention(*c, scale, heads_last=True, split=True)
                                           for c in cases], reps=50)
        res[f"b{b}_t{t}_merge_last_us"] = graph_us([lambda c=c: launch(*c, scale, counters) for c in cases],
                                                     reps=50)
        print(b, t, {k: v for k, v in res.items() if k.startswith(f"b{b}_t{t}")}, flush=True)
    if not check_only:
        json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "merge_last.json"), "w"), indent=1)
    assert all(v for k, v in res.items() if k.endswith("bits_equal"))


if __name__ == "__main__":
    main()

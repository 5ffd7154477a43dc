"""What one persistent kernel could gain over a launch a projection: a decode step's 144 projections at one row.

    python -m flashpd.bench.chain_bound --out bench/results/chain_bound.json

At batch 1 a Qwen3-8B step's projections run as 144 launches of the few-row GEMM (engine/skinny_gemm.py) and read
their weights at about 0.87 of the copy rate; a plain read of a weight's size reaches 0.86-0.97 only with eight
programs an SM (bench/read_ramp.py). Each launch pays its start, pipeline fill and tail. This measures the
alternative's bound before anyone builds it: the same projections, with the same tiles and K loop (so the same
bits), run by one persistent kernel whose programs walk every layer's four projections (q/k/v, o_proj, gate/up,
down) and meet at a grid-wide barrier between them, against the engine's 144 launches over the same weights in a
CUDA graph. Only the projections: no attention, norms or SwiGLU product (o_proj takes q/k/v's first columns,
down gate/up's first half), so neither figure is a step's time; what differs is the boundaries. A variant without
barriers (wrong data flow, timing only) bounds any design that keeps the projections as separate passes over the
weights. GB/s counts weight bytes read once.
"""
from __future__ import annotations

import argparse

import torch

from flashpd.bench.attn_micro import graph_time
from flashpd.bench.common import command_line, git_revision, kernel_bench_start, machine, write_json
from flashpd.engine import skinny_gemm, triton_env
from flashpd.engine.triton_env import INTERPRET, tl, triton

MAX_SPIN = 1 << 20  # a barrier's polls before it gives up and flags an error (programs not all resident)
BARRIERS = {"count": 1, "flag": 2, "flag_sleep": 3}  # `_grid_sync`'s forms (SYNC)

if triton is not None:
    @triton.jit
    def _project(x_ptr, sx, w_ptr, y_ptr, sy, M, pid, P, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr, XCG: tl.constexpr, F32: tl.constexpr,
                 w_pre, PK: tl.constexpr):
        """y[:M, tile] = x[:M, :K] @ w[tile].T for this program's column tiles (every P-th): the few-row GEMM's
        plain K loop, pipelined STAGES deep. x was written by other programs: XCG reads it past L1 (.cg).
        PK > 0: w_pre holds the first PK columns of this program's first tile (`_preload`, loaded before the
        barrier); they are multiplied first, as one dot (the MMAs walk its K in order: the same bits), and the
        pipelined loop starts after them."""
        rm = tl.arange(0, BM)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        steps: tl.constexpr = K // BK
        mine = (N // BN - pid + P - 1) // P  # this program's column tiles
        acc = tl.zeros([BM, BN], tl.float32)
        if PK > 0:
            if mine > 0:
                rp = tl.arange(0, PK)
                a = tl.load(x_ptr + rm[:, None] * sx + rp[None, :], mask=m_ok[:, None], other=0.0,
                            cache_modifier=".cg")
                if F32:
                    acc = tl.dot(a, tl.trans(w_pre), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(w_pre), acc)
        # the tile and K loops as one loop, as triton's persistent matmul has them: its pipeliner then streams the
        # next tile's first weight tiles while this tile's last ones are multiplied (nested, no loop was pipelined)
        for i in tl.range(PK // BK, mine * steps, num_stages=STAGES):
            t = pid + (i // steps) * P
            kk = i % steps
            k = kk * BK
            rn = t * BN + tl.arange(0, BN)
            if XCG:
                a = tl.load(x_ptr + rm[:, None] * sx + (k + rk)[None, :], mask=m_ok[:, None], other=0.0,
                            cache_modifier=".cg")
            else:
                a = tl.load(x_ptr + rm[:, None] * sx + (k + rk)[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptr + rn[:, None] * K + (k + rk)[None, :])
            acc = tl.where(kk == 0, 0.0, acc)  # a tile's sum starts from zero, bitwise as a fresh accumulator
            if F32:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
            if kk == steps - 1:
                tl.store(y_ptr + rm[:, None] * sy + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None])

    @triton.jit
    def _fence_or_sleep(x, SLEEP: tl.constexpr):
        """PTX `fence.acq_rel.gpu` (SLEEP 0) or `nanosleep.u32 SLEEP` in every thread; x: any int32 tensor (the
        asm's operand), returned as zeros."""
        if SLEEP:
            return tl.inline_asm_elementwise(f"nanosleep.u32 {SLEEP}; mov.u32 $0, 0;", "=r,r", [x], dtype=tl.int32,
                                             is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r", [x], dtype=tl.int32,
                                             is_pure=False, pack=1)

    @triton.jit
    def _grid_sync(bar_ptr, err_ptr, target, SYNC: tl.constexpr, SPIN: tl.constexpr, ASM: tl.constexpr):
        """Every program waits until `target` arrivals are counted (its own included); the writes before each
        arrival are visible after it. A program that polls SPIN times flags err_ptr, and no program waits once it is
        flagged (the grid was not all resident: the run is void, and ends). SYNC 0: no barrier (timing only);
        1: every program polls the arrival counter (bar_ptr[0]); 2: the last to arrive (its atomic returns
        target - 1) writes `target` to a flag on another 128-byte line (bar_ptr[32]), which the others poll, so
        that the counter's line takes only the arrivals; 3: as 2, each poll after a 32 ns sleep. ASM (the GPU):
        the acquire after the poll is a fence, not an atomic on the polled line (the interpreter has no asm)."""
        if SYNC == 1:
            tl.debug_barrier()  # the program's stores made before its arrival is counted
            tl.atomic_add(bar_ptr, 1, sem="release")
            n = 0
            while (tl.load(bar_ptr, volatile=True) < target) & (n < SPIN) & (tl.load(err_ptr, volatile=True) == 0):
                n += 1
            if n >= SPIN:
                tl.store(err_ptr, 1)
            tl.atomic_add(bar_ptr, 0, sem="acquire")
            tl.debug_barrier()
        elif SYNC >= 2:
            tl.debug_barrier()
            flag = bar_ptr + 32
            old = tl.atomic_add(bar_ptr, 1, sem="acq_rel")
            if old == target - 1:
                tl.atomic_xchg(flag, target, sem="release")
            n = 0
            while (tl.load(flag, volatile=True) < target) & (n < SPIN) & (tl.load(err_ptr, volatile=True) == 0):
                if SYNC == 3 and ASM:
                    _fence_or_sleep(tl.full([1], 0, tl.int32), 32)
                n += 1
            if n >= SPIN:
                tl.store(err_ptr, 1)
            if ASM:
                _fence_or_sleep(tl.full([1], 0, tl.int32), 0)
            else:
                tl.atomic_add(flag, 0, sem="acquire")
            tl.debug_barrier()

    @triton.jit
    def _prefetch(w_ptr, pid, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, PF: tl.constexpr):
        """Ask the L2 for the first PF 128-byte lines of each row of this program's first column tile of the next
        projection (its weights do not wait for the barrier): PTX prefetch.global.L2, one line an element."""
        if PF > 0:
            rows = pid * BN + tl.arange(0, BN)
            cols = tl.arange(0, PF) * 64
            ok = ((rows < N)[:, None] & (cols < K)[None, :]).to(tl.int32)
            tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; "
                                      "mov.u32 $0, 0; }", "=r,l,r", [w_ptr + rows[:, None] * K + cols[None, :], ok],
                                      dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _preload(w_ptr, pid, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, PK: tl.constexpr):
        """The first PK columns of this program's first column tile of the next projection, into registers before
        the barrier (weights do not wait for the last projection's output); zeros for a program with no tile, and
        a [BN, 16] placeholder when PK is 0."""
        rn = pid * BN + tl.arange(0, BN)
        if PK > 0:
            rp = tl.arange(0, PK)
            return tl.load(w_ptr + rn[:, None] * K + rp[None, :], mask=(rn < N)[:, None], other=0.0)
        else:
            return tl.zeros([BN, 16], w_ptr.dtype.element_ty)

    @triton.jit
    def _chain_kernel(w_ptr, offs_ptr, y0, y1, y2, y3, bar_ptr, err_ptr, M, L,
                      D: tl.constexpr, QKV: tl.constexpr, FF: tl.constexpr, BN: tl.constexpr, BN_WIDE: tl.constexpr,
                      BK: tl.constexpr, BM: tl.constexpr, SYNC: tl.constexpr, SPIN: tl.constexpr,
                      STAGES: tl.constexpr, XCG: tl.constexpr, F32: tl.constexpr, PF: tl.constexpr,
                      PK: tl.constexpr, ASM: tl.constexpr):
        """L layers of four projections. y3 holds the first layer's input; each layer: y0 = y3 @ qkv.T,
        y1 = y0[:, :D] @ o.T, y2 = y1 @ gate_up.T, y3 = y2[:, :FF] @ down.T, a barrier after each. PF > 0: before
        each barrier, the next projection's first weight lines are asked of the L2 (`_prefetch`). PK > 0: before
        each barrier, the first PK columns of the next projection's first tile are loaded into registers
        (`_preload`; PK // 2 for gate/up's tiles of twice the rows: the same bytes)."""
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        target = 0
        PKW: tl.constexpr = PK // 2
        # each weight's offset is a multiple of 16 elements: said, so that its loads are 16-byte vectors that
        # triton pipelines as asynchronous copies (unsaid, the K loop ran unpipelined, 6x slower)
        wq = w_ptr + tl.multiple_of(tl.load(offs_ptr), 16)
        pq = _preload(wq, pid, QKV, D, BN, PK)
        for layer in range(L):
            o = offs_ptr + layer * 4
            wo = w_ptr + tl.multiple_of(tl.load(o + 1), 16)
            wgu = w_ptr + tl.multiple_of(tl.load(o + 2), 16)
            wd = w_ptr + tl.multiple_of(tl.load(o + 3), 16)
            _project(y3, D, wq, y0, QKV, M, pid, P, QKV, D, BN, BK, BM, STAGES, XCG, F32, pq, PK)
            _prefetch(wo, pid, D, D, BN, PF)
            po = _preload(wo, pid, D, D, BN, PK)
            target += P
            _grid_sync(bar_ptr, err_ptr, target, SYNC, SPIN, ASM)
            _project(y0, QKV, wo, y1, D, M, pid, P, D, D, BN, BK, BM, STAGES, XCG, F32, po, PK)
            _prefetch(wgu, pid, 2 * FF, D, BN_WIDE, PF)
            pgu = _preload(wgu, pid, 2 * FF, D, BN_WIDE, PKW)
            target += P
            _grid_sync(bar_ptr, err_ptr, target, SYNC, SPIN, ASM)
            _project(y1, D, wgu, y2, 2 * FF, M, pid, P, 2 * FF, D, BN_WIDE, BK, BM, STAGES, XCG, F32, pgu, PKW)
            _prefetch(wd, pid, D, FF, BN, PF)
            pd = _preload(wd, pid, D, FF, BN, PK)
            target += P
            _grid_sync(bar_ptr, err_ptr, target, SYNC, SPIN, ASM)
            _project(y2, 2 * FF, wd, y3, D, M, pid, P, D, FF, BN, BK, BM, STAGES, XCG, F32, pd, PK)
            # the next layer's q/k/v (the table holds one more entry, repeating the last layer's: no branch)
            wq = w_ptr + tl.multiple_of(tl.load(o + 4), 16)
            _prefetch(wq, pid, QKV, D, BN, PF)
            pq = _preload(wq, pid, QKV, D, BN, PK)
            target += P
            _grid_sync(bar_ptr, err_ptr, target, SYNC, SPIN, ASM)


def available() -> bool:
    return triton is not None


class Chain:
    """L layers' four projection weights in one buffer (each [N, K], rows contiguous), the activations, and the
    two ways to run them."""

    def __init__(self, layers: int, d: int, qkv: int, ff: int, rows: int, device: torch.device | str,
                 seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> None:
        self.shapes = ((qkv, d), (d, d), (2 * ff, d), (d, ff))
        self.d, self.qkv, self.ff, self.layers, self.rows = d, qkv, ff, layers, rows
        per = sum(n * k for n, k in self.shapes)
        g = torch.Generator(device=device).manual_seed(seed)
        self.w = torch.empty(layers * per, dtype=dtype, device=device)
        self.views, offs = [], []
        for layer in range(layers):
            at = layer * per
            for n, k in self.shapes:
                v = self.w[at:at + n * k].view(n, k)
                v.copy_(torch.randn(n, k, generator=g, device=device, dtype=torch.float32) * k ** -0.5)
                self.views.append(v)
                offs.append(at)
                at += n * k
        self.offs = torch.tensor(offs + offs[-4:-3], dtype=torch.int64, device=device)  # + a last q/k/v offset
        self.x = torch.randn(rows, d, generator=g, device=device, dtype=torch.float32).to(dtype)
        self.y = [torch.zeros(rows, n, dtype=dtype, device=device) for n, _ in self.shapes]
        self.bar = torch.zeros(64, dtype=torch.int32, device=device)  # [0]: arrivals; [32]: the flag (_grid_sync)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)

    def weight_bytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def reference(self) -> torch.Tensor:
        """The chain in float64 (tests)."""
        h = self.x.double()
        for layer in range(self.layers):
            wq, wo, wgu, wd = (v.double() for v in self.views[4 * layer:4 * layer + 4])
            h = (((h @ wq.T)[:, :self.d] @ wo.T) @ wgu.T)[:, :self.ff] @ wd.T
        return h

    def run_persistent(self, programs: int, sync: bool = True, warps: int = 2, stages: int = 6, xcg: bool = True,
                       prefetch_lines: int = 0, preload_cols: int = 0, barrier: str = "count") -> torch.Tensor:
        """The persistent kernel (the K loops pipelined `stages` deep, the outer loops not; xcg: activations read
        past L1, as they must be: another SM wrote them; prefetch_lines: `_prefetch`'s PF, a power of two, 0 off:
        the GPU only; preload_cols: `_preload`'s PK, 0 off, else a power of two of at least twice the tile's K step
        and less than every projection's K; barrier: BARRIERS' forms of `_grid_sync`, with sync) -> the last layer's
        output [rows, d]."""
        bn, bk = skinny_gemm.TILE_NARROW[:2]
        if preload_cols and (preload_cols & (preload_cols - 1) or preload_cols < 2 * bk
                             or preload_cols >= min(self.d, self.ff)):
            raise ValueError(f"preload_cols {preload_cols}: a power of two, at least {2 * bk} and below "
                             f"{min(self.d, self.ff)} (every projection's K)")
        self.y[3][:, :self.d].copy_(self.x)
        if barrier not in BARRIERS:
            raise ValueError(f"barrier {barrier!r}: one of {list(BARRIERS)}")
        self.bar.zero_()
        _chain_kernel[(programs,)](self.w, self.offs, *self.y, self.bar, self.err, self.rows, self.layers,
                                   D=self.d, QKV=self.qkv, FF=self.ff, BN=bn, BN_WIDE=skinny_gemm.TILE_WIDE[0],
                                   BK=bk, BM=skinny_gemm.BLOCK_M, SYNC=BARRIERS[barrier] if sync else 0,
                                   SPIN=MAX_SPIN, STAGES=stages,
                                   XCG=int(xcg), F32=int(self.w.dtype == torch.float32), PF=prefetch_lines,
                                   PK=preload_cols, ASM=int(not INTERPRET),
                                   num_warps=warps,
                                   num_stages=1)
        return self.y[3]

    def run_launches(self) -> torch.Tensor:
        """The engine's few-row GEMM, one launch a projection (its tile for each weight, PDL as the engine)."""
        h = self.x
        for layer in range(self.layers):
            wq, wo, wgu, wd = self.views[4 * layer:4 * layer + 4]
            q = skinny_gemm.launch(h, wq, *skinny_gemm.tile(*wq.shape))
            o = skinny_gemm.launch(q[:, :self.d], wo, *skinny_gemm.tile(*wo.shape))
            gu = skinny_gemm.launch(o, wgu, *skinny_gemm.tile(*wgu.shape))
            h = skinny_gemm.launch(gu[:, :self.ff], wd, *skinny_gemm.tile(*wd.shape))
        return h


def recorder(rows: list[dict], gb: float, copy_gbs: float, reps: int, width: int):
    """record(name, fn, **extra): fn timed in a CUDA graph over `reps` runs; a row of µs, GB/s of the chain's `gb`
    weights and fraction of the copy rate (plus `extra`) appended to `rows` and printed (names right-aligned to
    `width`)."""
    def record(name: str, fn, **extra) -> None:
        us = graph_time(fn, reps=reps, inner=1)
        gbs = gb / (us * 1e-6)
        rows.append({"variant": name, "us": us, "gb_per_s": gbs, "of_copy_rate": gbs / copy_gbs, **extra})
        print(f"{name:>{width}}: {us / 1e3:7.3f} ms, {gbs:6.0f} GB/s ({gbs / copy_gbs:.3f} of the copy rate)"
              + "".join(f", {k} {v}" for k, v in extra.items()), flush=True)
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--programs-per-sm", default="1,2", help="the grid must be resident at once: a program's six "
                    "stages of gate/up's 32-row tiles take 72 KB of shared memory, so at most 3 an SM")
    ap.add_argument("--prefetch-lines", default="", help="persistent variants that ask the L2 for the next "
                    "projection's first weight lines before each barrier: 128-byte lines a row (powers of two)")
    ap.add_argument("--preload-cols", default="", help="persistent variants that load the first columns of the "
                    "next projection's first tile into registers before each barrier (powers of two, at least "
                    "twice the tile's K step)")
    ap.add_argument("--barriers", default="count", help=f"grid barrier forms to time ({', '.join(BARRIERS)}; "
                    "count: the plain form, always run)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/chain_bound.json")
    a = ap.parse_args()
    dev, sms, copy = kernel_bench_start("chain_bound")
    prefetch = [int(p) for p in a.prefetch_lines.split(",") if p]
    preload = [int(p) for p in a.preload_cols.split(",") if p]
    barriers = [b for b in a.barriers.split(",") if b]
    if any(b not in BARRIERS for b in barriers):
        ap.error(f"--barriers: each one of {list(BARRIERS)}")
    chain = Chain(a.layers, 4096, 6144, 12288, 1, dev)
    gb = chain.weight_bytes() / 1e9
    rows = []

    record = recorder(rows, gb, copy["gb_per_s"], a.reps, 32)

    want = chain.run_launches().clone()
    record("launches (engine)", chain.run_launches)
    for pps in (int(p) for p in a.programs_per_sm.split(",")):
        forms = ((6, True, 0, 0, "count"), (4, True, 0, 0, "count"), (6, False, 0, 0, "count")) \
            + tuple((6, True, p, 0, "count") for p in prefetch) + tuple((6, True, 0, k, "count") for k in preload) \
            + tuple((6, True, 0, 0, b) for b in barriers if b != "count")
        for stages, xcg, pf, pk, bar in forms:
            chain.err.zero_()
            got = chain.run_persistent(sms * pps, stages=stages, xcg=xcg, prefetch_lines=pf, preload_cols=pk,
                                       barrier=bar).clone()
            torch.cuda.synchronize()
            ok = chain.err.item() == 0
            same = bool(torch.equal(got, want)) if ok else None
            record(f"persistent, {pps} an SM, {stages} stages{'' if xcg else ', x via L1'}"
                   + (f", {pf} lines a row prefetched" if pf else "")
                   + (f", {pk} columns preloaded" if pk else "") + (f", barrier {bar}" if bar != "count" else ""),
                   lambda p=pps, s=stages, c=xcg, f=pf, k=pk, b=bar: chain.run_persistent(
                       sms * p, stages=s, xcg=c, prefetch_lines=f, preload_cols=k, barrier=b),
                   programs=sms * pps, stages=stages, x_past_l1=xcg, prefetch_lines=pf, preload_cols=pk, barrier=bar,
                   all_resident=ok and chain.err.item() == 0, same_bits_as_launches=same)
    record("no barriers (timing only), 2 an SM", lambda: chain.run_persistent(2 * sms, sync=False),
           programs=2 * sms)
    write_json(a.out, {"bench": "chain_bound", "git": git_revision(), "machine": machine(),
                       "command": command_line("flashpd.bench.chain_bound"), "copy_bandwidth": copy,
                       "pdl": triton_env.pdl(dev), "layers": a.layers, "weight_gb": gb, "rows": rows})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

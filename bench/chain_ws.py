"""chain_bound's persistent chain, warp-specialized: the weights' stream does not stop at the grid barriers.

    python -m flashpd.bench.chain_ws --out bench/results/chain_ws.json

bench/chain_bound.py found the engine's launches the fastest correct form of a batch-1 step's 144 projections it
could build, the same chain without barriers faster still, and that neither faster barriers nor weights preloaded
into registers close the gap: in those kernels the warps that stream a projection's weights are the warps that
wait at its barrier. Here they are not. One loader warp walks every projection's weight tiles in the chain's order
and copies them by TMA into a ring of shared-memory slots; it waits only for a free slot, never at a barrier, so it
runs ahead of the barriers by the ring's depth. The other warps wait at each barrier, take the projection's input
(one row) into shared memory, and multiply the ring's tiles as they land.

The same partitions also run as a kernel a projection (`run_ws_launches`), launched with programmatic dependent
launch: each kernel's loader lets the next kernel launch at once and never waits, so with a small ring two programs
share an SM and the next projection's weights stream while this one's are multiplied. That form would keep the
engine's launches (attention and norms between them) if it wins. `run_mma_launches` runs the engine's form of it,
engine/ws_gemm.py (MMAs, up to 16 rows, each row's sum over K in 16-column MMA steps in order as in the engine's
few-row kernel), compared with the engine's launches bit for bit.

The persistent kernel and `run_ws_launches` take one row, a batch-1 decode, as fp32 FMAs summed in another order
than the engine's MMAs: their result is checked against the float64 chain with a tolerance, not bitwise; they
measure the boundaries, not a kernel for the engine. Gluon (triton.experimental.gluon, triton 3.6 on the device),
sm_90 and up; weights laid out as two 2D tensors (every layer's q/k/v, o_proj and gate/up rows, whose K is the
hidden size; every down's rows) so that two TMA descriptors cover them. One program an SM (two, for the launches);
the ring's slots are [16, BK] tiles.
"""
from __future__ import annotations

import argparse

import torch

from flashpd.bench.chain_bound import MAX_SPIN, Chain, recorder
from flashpd.engine import ws_gemm

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # a barrier of the calling partition's warps: gl.thread_barrier in triton 3.6 (the device's), gl.barrier later
    _cta_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")
except (ImportError, AttributeError):  # no triton, or no Gluon these kernels know: the bench says so when run
    gluon = None

BN = 16  # output columns a tile (the engine's narrow tile)
SMEM_BYTES = 227 * 1024  # one program's shared memory on an H100 / H200

if gluon is not None:
    @gluon.jit
    def _weight_ring(desc, S: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        """The loader's ring: S slots of desc's [BN, BK] tiles, and per slot a `ready` barrier (its copy landed)
        and an `empty` one (the consumers have read it), each counting one arrival."""
        ring = gl.allocate_shared_memory(desc.dtype, [S, BN, BK], desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(S):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        return ring, ready, empty

    @gluon.jit
    def _load_proj(desc, ring, ready, empty, it, pid, P, row0, N: gl.constexpr, K: gl.constexpr,
                   BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr):
        """The loader's walk of one projection: this program's column tiles (every P-th), each K step into the
        next ring slot once it is free (`empty`), `ready` completing when the copy lands. -> the items issued."""
        steps: gl.constexpr = K // BK
        mine = (N // BN - pid + P - 1) // P
        for i in range(mine * steps):
            s = it % S
            mbarrier.wait(empty.index(s), ((it // S) & 1) ^ 1)  # a fresh barrier counts as freed: pass at once
            mbarrier.expect(ready.index(s), BN * BK * 2)
            tma.async_copy_global_to_shared(desc, [row0 + (pid + (i // steps) * P) * BN, (i % steps) * BK],
                                            ready.index(s), ring.index(s))
            it += 1
        return it

    @gluon.jit
    def _loader(wa_desc, wd_desc, ring, ready, empty, pid, P, L, D: gl.constexpr, QKV: gl.constexpr,
                FF: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr):
        """The worker partition: every layer's four weights in the chain's order, never waiting at a barrier."""
        RA: gl.constexpr = QKV + D + 2 * FF  # a layer's rows in wa: q/k/v, o_proj, gate/up
        it = pid * 0
        for layer in range(L):
            base = layer * RA
            it = _load_proj(wa_desc, ring, ready, empty, it, pid, P, base, QKV, D, BN, BK, S)
            it = _load_proj(wa_desc, ring, ready, empty, it, pid, P, base + QKV, D, D, BN, BK, S)
            it = _load_proj(wa_desc, ring, ready, empty, it, pid, P, base + QKV + D, 2 * FF, D, BN, BK, S)
            it = _load_proj(wd_desc, ring, ready, empty, it, pid, P, layer * D, D, FF, BN, BK, S)

    @gluon.jit
    def _mult_proj(x_ptr, y_ptr, xs, ring, ready, empty, it, pid, P, N: gl.constexpr, K: gl.constexpr,
                   KP: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, LW: gl.constexpr,
                   LX: gl.constexpr):
        """y[0, tiles] = x[0, :K] @ w[tiles].T for this program's tiles, the weight tiles from the ring in the
        loader's order. x (one row, written by other SMs: read past L1) goes to shared memory first, in one load
        of KP (K's next power of two) columns, the ones past K masked. -> the items consumed."""
        steps: gl.constexpr = K // BK
        rows = gl.arange(0, KP // BK, layout=gl.SliceLayout(1, LX))
        cols = gl.arange(0, BK, layout=gl.SliceLayout(0, LX))
        xv = gl.load(x_ptr + rows[:, None] * BK + cols[None, :], mask=(rows < steps)[:, None], other=0.0,
                     cache_modifier=".cg")
        xs.slice(0, KP // BK).store(xv)
        _cta_barrier()
        xr = xs._reinterpret(xs.dtype, xs.shape, gl.SwizzledSharedLayout(1, 1, 1, [0]))  # its rows, by index
        mine = (N // BN - pid + P - 1) // P
        rn = gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
        for j in range(mine):
            acc = gl.zeros([BN, BK], gl.float32, LW)
            for kk in range(steps):
                s = it % S
                mbarrier.wait(ready.index(s), (it // S) & 1)
                w = ring.index(s).load(LW)
                xk = xr.index(kk).load(gl.SliceLayout(0, LW))
                _cta_barrier()  # every warp has read the slot
                fence_async_shared()  # ... before the loader's next copy into it
                mbarrier.arrive(empty.index(s), count=1)
                acc += w.to(gl.float32) * xk.to(gl.float32)[None, :]
                it += 1
            y = gl.sum(acc, axis=1)
            gl.store(y_ptr + (pid + j * P) * BN + rn, y.to(y_ptr.dtype.element_ty))
        return it

    @gluon.jit
    def _grid_sync(bar_ptr, err_ptr, target, SPIN: gl.constexpr):
        """Every program waits until `target` arrivals are counted (chain_bound's counter barrier)."""
        _cta_barrier()  # the program's stores made before its arrival is counted
        gl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        n = 0
        while (gl.load(bar_ptr, volatile=True) < target) & (n < SPIN) & (gl.load(err_ptr, volatile=True) == 0):
            n += 1
        if n >= SPIN:
            gl.store(err_ptr, 1)
        # the acquire: a fence in every thread (an atomic add of 0 whose result is unused is removed as dead code)
        gl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r",
                                  [gl.full([32], 0, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))],
                                  dtype=gl.int32, is_pure=False, pack=1)
        _cta_barrier()

    @gluon.jit
    def _barrier(bar_ptr, err_ptr, target, P, SYNC: gl.constexpr, SPIN: gl.constexpr):
        """A projection's end: with SYNC, the grid barrier (P more arrivals) -> the arrivals counted so far."""
        if SYNC:
            target += P
            _grid_sync(bar_ptr, err_ptr, target, SPIN)
        return target

    @gluon.jit
    def _consumer(y0, y1, y2, y3, bar_ptr, err_ptr, xs, ring, ready, empty, pid, P, L, D: gl.constexpr,
                  QKV: gl.constexpr, FF: gl.constexpr, FFP: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                  S: gl.constexpr, SYNC: gl.constexpr, SPIN: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr):
        """The default partition: y0 = y3 @ qkv.T, y1 = y0[:, :D] @ o.T, y2 = y1 @ gate_up.T,
        y3 = y2[:, :FF] @ down.T a layer (chain_bound's data flow), a grid barrier after each (SYNC)."""
        it = pid * 0
        target = pid * 0
        for layer in range(L):
            it = _mult_proj(y3, y0, xs, ring, ready, empty, it, pid, P, QKV, D, D, BN, BK, S, LW, LX)
            target = _barrier(bar_ptr, err_ptr, target, P, SYNC, SPIN)
            it = _mult_proj(y0, y1, xs, ring, ready, empty, it, pid, P, D, D, D, BN, BK, S, LW, LX)
            target = _barrier(bar_ptr, err_ptr, target, P, SYNC, SPIN)
            it = _mult_proj(y1, y2, xs, ring, ready, empty, it, pid, P, 2 * FF, D, D, BN, BK, S, LW, LX)
            target = _barrier(bar_ptr, err_ptr, target, P, SYNC, SPIN)
            it = _mult_proj(y2, y3, xs, ring, ready, empty, it, pid, P, D, FF, FFP, BN, BK, S, LW, LX)
            target = _barrier(bar_ptr, err_ptr, target, P, SYNC, SPIN)

    @gluon.jit
    def _chain_ws_kernel(wa_desc, wd_desc, y0, y1, y2, y3, bar_ptr, err_ptr, L, D: gl.constexpr,
                         QKV: gl.constexpr, FF: gl.constexpr, FFP: gl.constexpr, BN: gl.constexpr,
                         BK: gl.constexpr, S: gl.constexpr,
                         SYNC: gl.constexpr, SPIN: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr,
                         LOADER_REGS: gl.constexpr):
        ring, ready, empty = _weight_ring(wa_desc, S, BN, BK)
        xs = gl.allocate_shared_memory(wa_desc.dtype, [FFP // BK, BK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        gl.warp_specialize([
            (_consumer, (y0, y1, y2, y3, bar_ptr, err_ptr, xs, ring, ready, empty, pid, P, L, D, QKV, FF, FFP, BN,
                         BK, S, SYNC, SPIN, LW, LX)),
            (_loader, (wa_desc, wd_desc, ring, ready, empty, pid, P, L, D, QKV, FF, BN, BK, S)),
        ], [1], [LOADER_REGS])

    @gluon.jit
    def _proj_consumer(x_ptr, y_ptr, xs, ring, ready, empty, pid, P, N: gl.constexpr, K: gl.constexpr,
                       KP: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, LW: gl.constexpr,
                       LX: gl.constexpr, PDL: gl.constexpr):
        if PDL:
            ws_gemm.gdc(True)  # x is the kernel ahead's output
        _mult_proj(x_ptr, y_ptr, xs, ring, ready, empty, pid * 0, pid, P, N, K, KP, BN, BK, S, LW, LX)

    @gluon.jit
    def _proj_loader(desc, ring, ready, empty, pid, P, row0, N: gl.constexpr, K: gl.constexpr, BN: gl.constexpr,
                     BK: gl.constexpr, S: gl.constexpr, PDL: gl.constexpr):
        if PDL:
            ws_gemm.gdc(False)  # at once: the next kernel's loader may stream its weights beside this one
        _load_proj(desc, ring, ready, empty, pid * 0, pid, P, row0, N, K, BN, BK, S)

    @gluon.jit
    def _proj_ws_kernel(desc, x_ptr, y_ptr, row0, N: gl.constexpr, K: gl.constexpr, KP: gl.constexpr,
                        BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr,
                        PDL: gl.constexpr, LOADER_REGS: gl.constexpr):
        """One projection, y[0] = x[0, :K] @ w.T, w the N rows of desc's tensor from row0, on a program an SM:
        the chain's partitions for one weight. With PDL the loader lets the next launch go at once and never
        waits: its weights do not depend on the kernel ahead; only the consumers wait before reading x."""
        ring, ready, empty = _weight_ring(desc, S, BN, BK)
        xs = gl.allocate_shared_memory(desc.dtype, [KP // BK, BK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        gl.warp_specialize([
            (_proj_consumer, (x_ptr, y_ptr, xs, ring, ready, empty, pid, P, N, K, KP, BN, BK, S, LW, LX, PDL)),
            (_proj_loader, (desc, ring, ready, empty, pid, P, row0, N, K, BN, BK, S, PDL)),
        ], [1], [LOADER_REGS])


def available() -> bool:
    return gluon is not None


def layouts(bk: int, warps: int = 4) -> tuple[object, object]:
    """(LW, LX): a [16, bk] weight tile over the consumer's warps, 16-byte vectors along K (each warp reads whole
    rows: no bank conflicts without a swizzle); the input as [K / bk, bk] rows, the same way."""
    lanes_k = min(32, bk // 8)
    lw = gl.BlockedLayout([1, 8], [32 // lanes_k, lanes_k], [warps, 1], [1, 0])
    return lw, lw


class WsChain(Chain):
    """chain_bound's Chain with its weights in two 2D buffers, so that two TMA descriptors reach every tile: wa
    [layers * (qkv + d + 2 ff), d] (a layer's q/k/v, o_proj and gate/up rows) and wd [layers * d, ff] (the downs).
    `views` point into them, so the reference and the launches read the same weights."""

    def __init__(self, layers: int, d: int, qkv: int, ff: int, device: torch.device | str, seed: int = 0,
                 rows: int = 1) -> None:
        if not 1 <= rows <= 16:
            raise ValueError(f"rows {rows}: 1 to 16 (a decode's to a verify's)")
        self.shapes = ((qkv, d), (d, d), (2 * ff, d), (d, ff))
        self.d, self.qkv, self.ff, self.layers, self.rows = d, qkv, ff, layers, rows
        ra = qkv + d + 2 * ff
        g = torch.Generator(device=device).manual_seed(seed)
        self.wa = torch.empty(layers * ra, d, dtype=torch.bfloat16, device=device)
        self.wd = torch.empty(layers * d, ff, dtype=torch.bfloat16, device=device)
        self.views = []
        for layer in range(layers):
            at = layer * ra
            for n, k in self.shapes[:3]:
                self.views.append(self.wa[at:at + n])
                at += n
            self.views.append(self.wd[layer * d:(layer + 1) * d])
            for v in self.views[-4:]:
                n, k = v.shape
                v.copy_(torch.randn(n, k, generator=g, device=device, dtype=torch.float32) * k ** -0.5)
        self.x = torch.randn(rows, d, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
        self.y = [torch.zeros(rows, n, dtype=torch.bfloat16, device=device) for n, _ in self.shapes]
        self.bar = torch.zeros(64, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self._descs: dict[int, tuple[object, object]] = {}

    def weight_bytes(self) -> int:
        return (self.wa.numel() + self.wd.numel()) * 2

    def _check(self, bk: int, one_row: bool) -> None:
        """ValueError unless every weight splits into [16, bk] tiles and, for the FMA kernels, there is one row."""
        if one_row and self.rows != 1:
            raise ValueError("the FMA kernels take one row (a batch-1 decode); run_mma_launches takes up to 16")
        for n, k in self.shapes:
            if n % BN or k % bk:
                raise ValueError(f"a [{n}, {k}] weight does not split into [{BN}, {bk}] tiles")

    def _launches(self, bk: int):
        """Each projection of the chain in order, as (its index in a layer, N, K, its weight's descriptor, its first
        row there), the first layer's input copied in."""
        wa_desc, wd_desc = self.descriptors(bk)
        ra = self.qkv + self.d + 2 * self.ff
        self.y[3][:, :self.d].copy_(self.x)
        for layer in range(self.layers):
            rows = (layer * ra, layer * ra + self.qkv, layer * ra + self.qkv + self.d, layer * self.d)
            for j, ((n, k), desc, row0) in enumerate(zip(self.shapes, (wa_desc, wa_desc, wa_desc, wd_desc), rows)):
                yield j, n, k, desc, row0

    def descriptors(self, bk: int) -> tuple[object, object]:
        """The two TMA descriptors for [16, bk] tiles (no swizzle: the consumer reads whole rows)."""
        if bk not in self._descs:
            lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
            self._descs[bk] = (TensorDescriptor.from_tensor(self.wa, [BN, bk], lay),
                               TensorDescriptor.from_tensor(self.wd, [BN, bk], lay))
        return self._descs[bk]

    def run_ws(self, programs: int, bk: int = 256, slots: int = 16, sync: bool = True,
               loader_regs: int = 40) -> torch.Tensor:
        """The warp-specialized chain on `programs` programs (all must be resident: one an SM), slots of [16, bk]
        -> the last layer's output [1, d]."""
        self._check(bk, one_row=True)
        lw, lx = layouts(bk)
        wa_desc, wd_desc = self.descriptors(bk)
        self.y[3][:, :self.d].copy_(self.x)
        self.bar.zero_()
        _chain_ws_kernel[(programs,)](wa_desc, wd_desc, *self.y, self.bar, self.err, self.layers, D=self.d,
                                      QKV=self.qkv, FF=self.ff, FFP=triton.next_power_of_2(self.ff), BN=BN, BK=bk,
                                      S=slots, SYNC=int(sync), SPIN=MAX_SPIN, LW=lw, LX=lx, LOADER_REGS=loader_regs,
                                      num_warps=4)
        return self.y[3]

    def run_ws_launches(self, programs: int, bk: int = 256, slots: int = 8, pdl: bool = True,
                        loader_regs: int = 40) -> torch.Tensor:
        """The chain as 144 launches of the one-projection kernel (`_proj_ws_kernel`), each on `programs`
        programs; pdl: launched with programmatic dependent launch, each letting the next go at its start (with
        maxnreg 128 and a small ring two programs share an SM, so the next projection's weights stream during this
        one) -> the last layer's output [1, d]."""
        self._check(bk, one_row=True)
        lw, lx = layouts(bk)
        for j, n, k, desc, row0 in self._launches(bk):
            _proj_ws_kernel[(programs,)](desc, self.y[(j - 1) % 4], self.y[j], row0, N=n, K=k,
                                         KP=triton.next_power_of_2(k), BN=BN, BK=bk, S=slots, LW=lw, LX=lx,
                                         PDL=int(pdl), LOADER_REGS=loader_regs, num_warps=4, maxnreg=128,
                                         launch_pdl=pdl)
        return self.y[3]

    def run_mma_launches(self, bk: int = 256, slots: int = 8, x_slots: int = 4, pdl: bool = True) -> torch.Tensor:
        """The chain as 144 launches of the engine's warp-specialized few-row kernel (engine/ws_gemm.py, its plain
        form: MMAs, up to 16 rows; PDL as `run_ws_launches`), on the same views as `run_launches`
        -> the last layer's output [rows, d]."""
        self._check(bk, one_row=False)
        h = self.x
        for layer in range(self.layers):
            wq, wo, wgu, wd = self.views[4 * layer:4 * layer + 4]
            q = ws_gemm.launch_fused(h, wq, None, 0.0, False, None, None, pdl, bk, slots, x_slots)[0]
            o = ws_gemm.launch_fused(q[:, :self.d], wo, None, 0.0, False, None, None, pdl, bk, slots, x_slots)[0]
            gu = ws_gemm.launch_fused(o, wgu, None, 0.0, False, None, None, pdl, bk, slots, x_slots)[0]
            h = ws_gemm.launch_fused(gu[:, :self.ff], wd, None, 0.0, False, None, None, pdl, bk, slots, x_slots)[0]
        return h


def main() -> None:
    from flashpd.bench.common import command_line, git_revision, kernel_bench_start, machine, write_json
    from flashpd.engine import triton_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--bk", default="256,128", help="K columns a ring slot (slots are [16, BK] bf16)")
    ap.add_argument("--slots", default="8,16,24", help="ring depths to time (at BK 256 a slot is 8 KB; the "
                    "ring and the input's 32 KB must fit one program's shared memory)")
    ap.add_argument("--launch-slots", default="4,8", help="ring depths of the one-projection launches (small, "
                    "so that two programs share an SM and the next launch's loader streams beside this one)")
    ap.add_argument("--mma-slots", type=int, default=8, help="weight ring depth of the MMA launches")
    ap.add_argument("--mma-x-slots", type=int, default=4, help="input ring depth of the MMA launches (items "
                    "fetched ahead)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/chain_ws.json")
    a = ap.parse_args()
    dev, sms, copy = kernel_bench_start("chain_ws")
    if gluon is None or not ws_gemm.available():
        raise SystemExit("chain_ws needs triton with Gluon (triton.experimental.gluon)")
    chain = WsChain(a.layers, 4096, 6144, 12288, dev)
    gb = chain.weight_bytes() / 1e9
    ref = chain.reference().float()
    rows = []

    record = recorder(rows, gb, copy["gb_per_s"], a.reps, 40)

    def error(got: torch.Tensor) -> float:
        return float((got.float() - ref).abs().max() / ref.abs().max())

    launches = chain.run_launches().clone()
    record("launches (engine)", chain.run_launches, rel_err_vs_fp64=error(launches))
    for bk in (int(b) for b in a.bk.split(",")):
        for slots in (int(s) for s in a.slots.split(",")):
            if slots * BN * bk * 2 + triton.next_power_of_2(chain.ff) * 2 + 1024 > SMEM_BYTES:
                print(f"skip BK {bk}, {slots} slots: over one program's shared memory", flush=True)
                continue
            for sync in (True, False):
                chain.err.zero_()
                got = chain.run_ws(sms, bk=bk, slots=slots, sync=sync).clone()
                torch.cuda.synchronize()
                resident = chain.err.item() == 0
                err = error(got)
                record(f"ws, BK {bk}, {slots} slots" + ("" if sync else ", no barriers (timing only)"),
                       lambda b=bk, s=slots, y=sync: chain.run_ws(sms, bk=b, slots=s, sync=y), programs=sms, bk=bk,
                       slots=slots, barriers=sync, all_resident=resident if sync else None,
                       rel_err_vs_fp64=err if sync else None)
    for bk in (int(b) for b in a.bk.split(",")):
        for slots in (int(s) for s in a.launch_slots.split(",")):
            for pdl in (True, False):
                got = chain.run_ws_launches(sms, bk=bk, slots=slots, pdl=pdl).clone()
                record(f"ws launches, BK {bk}, {slots} slots" + (", PDL" if pdl else ""),
                       lambda b=bk, s=slots, p=pdl: chain.run_ws_launches(sms, bk=b, slots=s, pdl=p),
                       programs=sms, bk=bk, slots=slots, pdl=pdl, rel_err_vs_fp64=error(got))
    for bk in (int(b) for b in a.bk.split(",")):
        for pdl in (True, False):
            got = chain.run_mma_launches(bk=bk, slots=a.mma_slots, x_slots=a.mma_x_slots, pdl=pdl).clone()
            record(f"mma launches, BK {bk}, {a.mma_slots} + {a.mma_x_slots} slots" + (", PDL" if pdl else ""),
                   lambda b=bk, p=pdl: chain.run_mma_launches(bk=b, slots=a.mma_slots, x_slots=a.mma_x_slots,
                                                              pdl=p),
                   programs=sms, bk=bk, slots=a.mma_slots, x_slots=a.mma_x_slots, pdl=pdl,
                   rel_err_vs_fp64=error(got), same_bits_as_launches=bool(torch.equal(got, launches)))
    write_json(a.out, {"bench": "chain_ws", "git": git_revision(), "machine": machine(),
                       "command": command_line("flashpd.bench.chain_ws"), "copy_bandwidth": copy,
                       "pdl": triton_env.pdl(dev), "layers": a.layers, "weight_gb": gb,
                       "launches_rel_err_vs_fp64": error(launches), "rows": rows})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

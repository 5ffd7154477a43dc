"""The few-row projection (skinny_gemm) warp-specialized: the weight streams from the launch's start. Off by default.

skinny_gemm's kernel waits for the kernel ahead (PDL) before its first load, so each of a batch-1 step's ~145
projections pays its own start, pipeline fill and tail (docs/results.md, issue 23). Here one program an SM walks
its column tiles; a loader warp copies their weight tiles by TMA into a ring of shared-memory slots from the start,
waiting only for free slots, and lets the next kernel launch at once. With a small ring and 128 registers a thread
two programs share an SM, so the next projection's weights stream beside this one's (bench/chain_ws.py measures
that chain, `run_mma_launches`). Two consumer warps wait for the kernel ahead, take x's [16, BK] tiles by TMA
(rows past M zero-filled) into a ring of their own, and multiply with MMAs over K in 16-column steps in order, as
tl.dot does in skinny_gemm's kernel (each warp one 8-column half, the instruction's own K grouping); the epilogues
are that kernel's fused forms (RMS, SwiGLU, residual + next norm), a tile at a time, with one partial sum of squares
a tile (as that kernel's programs write them). A row's bits depend on that row alone, so a decode's one row and a
verify's sixteen agree as in skinny_gemm; the epilogues' sums may round otherwise than that kernel's.

Shared memory, not HBM, is what such a kernel can run out of: every weight byte is written once by TMA and read by
ldmatrix, and x's tile (16 rows, most of them zeros at batch 1) is written and read beside it. Tiles are [rows, 64]
with a 128-byte swizzle, so an 8-row ldmatrix meets 8 bank groups (a [16, 256] tile unswizzled puts its rows 512
bytes apart, in one bank group: 8-way conflicts), and no warp repeats another's MMAs: about 5 bytes of shared
traffic a weight byte, against the ~8 a byte an SM's 128 bytes a clock allow at the copy rate.

Gluon (triton.experimental.gluon), sm_90 and up, bf16 or fp16 weights (an fp8 weight keeps skinny_gemm's kernel).
ENABLED is off: measured on an H200 (`speed_8b --ws-gemm`, docs/results.md), it is bitwise skinny_gemm's kernel and
slower in the step (a batch-1 step 31% longer). Its two consumer warps an SM are the likely bound (each MMA waits
on its own ldmatrix; the Triton kernel hides that latency with many programs an SM): not profiled.
"""
from __future__ import annotations

import torch

from flashpd.engine import triton_env

ENABLED = False  # skinny_gemm routes its bf16/fp16 forms here on CUDA when on (and Gluon imports)
BN = 16  # output columns a tile (a SwiGLU tile: 16 gate and 16 up rows), skinny_gemm's narrow tile
BKS = (256, 128, 64)  # K columns a slot: the largest that divides K
SUB = 64  # K columns a TMA box and a shared tile: 128 bytes of bf16, the widest rows a 128-byte swizzle takes
SLOTS = 8  # the weight ring: 8 slots of [16, BK] (64 KB at BK 256; SwiGLU: half as many of [32, BK])
X_SLOTS = 4  # x's ring: tiles fetched ahead
WARPS = 2  # the consumers: one 8-column MMA half of the 16-column tile each, as skinny_gemm's 2 warps (4 would
# repeat a half's MMAs and read x's tile 4 times: shared memory's bandwidth, not HBM's, would bound the kernel)
IDLE_WARPS = 4  # the default partition, idle: Gluon wants a multiple of 4 warps there, the consumers are 2
WORKER_REGS = 168  # the loader's and consumers' warpgroup; the idle one keeps 2 * 128 - 168

gluon = None
if triton_env.triton is not None and not triton_env.INTERPRET:  # a CUDA build of torch (the interpreter: no Gluon)
    try:
        import triton
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, mma_v2, tma
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        # a barrier of the calling partition's warps: gl.thread_barrier in triton 3.6, gl.barrier later
        _cta_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")
    except (ImportError, AttributeError):  # a triton without Gluon, or with one these kernels do not know
        gluon = None

if gluon is not None:

    @gluon.jit
    def gdc(WAIT: gl.constexpr):
        """griddepcontrol in every thread of the partition: wait for the kernel ahead to finish, its writes
        visible (WAIT), or let the next kernel launch (the program's first call counts)."""
        z = gl.full([32], 0, gl.int32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
        if WAIT:
            gl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r,r", [z], dtype=gl.int32,
                                      is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r,r", [z],
                                      dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _loader(w_desc, ring, ready, empty, pid, P, N, K, BN: gl.constexpr, BK: gl.constexpr, SUB: gl.constexpr,
                S: gl.constexpr, SWIGLU: gl.constexpr, PDL: gl.constexpr):
        """A worker partition of one warp: this program's tiles (every P-th), each K step's weight tile (SwiGLU: its
        gate and up rows, N apart) into the next free slot. Never waits for the kernel ahead: the weight is not its
        output."""
        if PDL:
            gdc(False)
        NSUB: gl.constexpr = BK // SUB
        G: gl.constexpr = 2 if SWIGLU else 1
        steps = K // BK
        total = ((N // BN - pid + P - 1) // P) * steps
        for i in range(total):
            s = i % S
            mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)  # a fresh barrier counts as freed
            n0 = (pid + (i // steps) * P) * BN
            k = (i % steps) * BK
            mbarrier.expect(ready.index(s), G * NSUB * w_desc.block_type.nbytes)
            for j in gl.static_range(NSUB):  # slot s is tiles (s * NSUB + j) * G (+ 1: SwiGLU's up rows, N on)
                tma.async_copy_global_to_shared(w_desc, [n0, k + j * SUB], ready.index(s),
                                                ring.index((s * NSUB + j) * G))
                if SWIGLU:
                    tma.async_copy_global_to_shared(w_desc, [N + n0, k + j * SUB], ready.index(s),
                                                    ring.index((s * NSUB + j) * G + 1))

    @gluon.jit
    def _x_fetch(x_desc, x_ring, x_ready, i, total, steps, BK: gl.constexpr, SUB: gl.constexpr,
                 XS: gl.constexpr):
        """Item i's x tile [16, BK] (BK / SUB tiles of [16, SUB]) into x slot i % XS, if i < total (the same K
        step's tile for every column tile)."""
        NSUB: gl.constexpr = BK // SUB
        ok = i < total
        slot = i % XS
        mbarrier.expect(x_ready.index(slot), NSUB * x_desc.block_type.nbytes, pred=ok)
        for j in gl.static_range(NSUB):
            tma.async_copy_global_to_shared(x_desc, [0, (i % steps) * BK + j * SUB], x_ready.index(slot),
                                            x_ring.index(slot * NSUB + j), pred=ok)

    @gluon.jit
    def _consumer(x_desc, y_ptr, M, N, K, sym, ss_ptr, P_SS, eps, r_ptr, srm, g_ptr, xg_ptr, sso_ptr, x_ring,
                  x_ready, ring, ready, empty, pid, P, BN: gl.constexpr, BK: gl.constexpr, SUB: gl.constexpr,
                  S: gl.constexpr, XS: gl.constexpr, RMS: gl.constexpr, SWIGLU: gl.constexpr, RESID: gl.constexpr,
                  NEXT: gl.constexpr, P_PAD: gl.constexpr, PDL: gl.constexpr):
        """A worker partition of WARPS warps: the MMAs and skinny_gemm's epilogues, a column tile at a time."""
        if PDL:
            gdc(True)  # x, ss and the residual are the kernels ahead's outputs
        NSUB: gl.constexpr = BK // SUB
        G: gl.constexpr = 2 if SWIGLU else 1
        steps = K // BK
        tiles = N // BN
        total = ((tiles - pid + P - 1) // P) * steps
        for i in gl.static_range(XS):
            _x_fetch(x_desc, x_ring, x_ready, i, total, steps, BK, SUB, XS)
        # each warp one 8-column half of the tile, as skinny_gemm's two warps; k_width 2, the instruction's own: an
        # MMA sums k 16j .. 16j + 15, in order over j, as tl.dot's (a wider k_width would group K otherwise)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, gl.num_warps()],
                                                      instr_shape=[16, 8])
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        rm = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
        rn = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        m_ok = rm < M
        if RMS:  # each row's 1/rms from the partial sums of its stream's squares, once for every tile
            pp = gl.arange(0, P_PAD, layout=gl.SliceLayout(0, mma))
            ss = gl.load(ss_ptr + rm[:, None] * P_SS + pp[None, :], mask=m_ok[:, None] & (pp < P_SS)[None, :],
                         other=0.0)
            scale = 1.0 / gl.sqrt(gl.sum(ss, 1) / K + eps)
        i = pid * 0
        for t in range(pid, tiles, P):
            cols = t * BN + rn
            out_ok = m_ok[:, None] & (cols < N)[None, :]
            # the epilogue's operands loaded before the K loop, their latency behind the weight's stream
            if RESID:
                r = gl.load(r_ptr + rm[:, None] * srm + cols[None, :], mask=out_ok, other=0.0)
            if NEXT:
                gw = gl.load(g_ptr + cols).to(gl.float32)
            acc = gl.zeros([16, BN], gl.float32, mma)
            if SWIGLU:
                acc_up = gl.zeros([16, BN], gl.float32, mma)
            for kk in range(steps):
                xslot = i % XS
                mbarrier.wait(x_ready.index(xslot), (i // XS) & 1)
                s = i % S
                mbarrier.wait(ready.index(s), (i // S) & 1)
                for j in gl.static_range(NSUB):
                    a = x_ring.index(xslot * NSUB + j).load(la)
                    acc = mma_v2(a, ring.index((s * NSUB + j) * G).permute([1, 0]).load(lb), acc)
                    if SWIGLU:
                        acc_up = mma_v2(a, ring.index((s * NSUB + j) * G + 1).permute([1, 0]).load(lb), acc_up)
                _cta_barrier()  # every warp has read both slots
                fence_async_shared()  # ... before the next copies into them
                mbarrier.arrive(empty.index(s), count=1)
                _x_fetch(x_desc, x_ring, x_ready, i + XS, total, steps, BK, SUB, XS)
                i += 1
            if RMS:
                acc = acc * scale[:, None]
                if SWIGLU:
                    acc_up = acc_up * scale[:, None]
            if SWIGLU:  # gate and up rounded as the unfused matmul's output, the product in fp32
                gate = acc.to(y_ptr.dtype.element_ty).to(gl.float32)
                up = acc_up.to(y_ptr.dtype.element_ty).to(gl.float32)
                y = (gate * (1.0 / (1.0 + gl.exp(-gate))) * up).to(y_ptr.dtype.element_ty)
            else:
                y = acc.to(y_ptr.dtype.element_ty)
            if RESID:
                y = (y.to(gl.float32) + r.to(gl.float32)).to(y_ptr.dtype.element_ty)
            gl.store(y_ptr + rm[:, None] * sym + cols[None, :], y, mask=out_ok)
            if NEXT:
                yf = gl.where(out_ok, y.to(gl.float32), 0.0)
                gl.store(xg_ptr + rm[:, None] * sym + cols[None, :], (yf * gw[None, :]).to(y_ptr.dtype.element_ty),
                         mask=out_ok)
                gl.store(sso_ptr + rm * tiles + t, gl.sum(yf * yf, 1), mask=m_ok)

    @gluon.jit
    def _idle():
        """The default partition: nothing (the loader and the consumers are workers, see IDLE_WARPS)."""
        pass

    @gluon.jit
    def _ws_kernel(w_desc, x_desc, y_ptr, M, N, K, sym, ss_ptr, P_SS, eps, r_ptr, srm, g_ptr, xg_ptr, sso_ptr,
                   BN: gl.constexpr, BK: gl.constexpr, SUB: gl.constexpr, S: gl.constexpr, XS: gl.constexpr,
                   RMS: gl.constexpr, SWIGLU: gl.constexpr, RESID: gl.constexpr, NEXT: gl.constexpr,
                   P_PAD: gl.constexpr, PDL: gl.constexpr, WARPS: gl.constexpr, WORKER_REGS: gl.constexpr):
        NSUB: gl.constexpr = BK // SUB
        G: gl.constexpr = 2 if SWIGLU else 1
        # [16, SUB] tiles, 128-byte swizzled: an MMA operand's 8-row ldmatrix reads 8 distinct bank groups (rows of
        # a whole [16, BK] tile lie BK * 2 bytes apart, one bank group: 8-way conflicts)
        ring = gl.allocate_shared_memory(w_desc.dtype, [S * NSUB * G, BN, SUB], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        x_ring = gl.allocate_shared_memory(x_desc.dtype, [XS * NSUB, 16, SUB], x_desc.layout)
        x_ready = gl.allocate_shared_memory(gl.int64, [XS, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(S):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=1)
        for j in gl.static_range(XS):
            mbarrier.init(x_ready.index(j), count=1)
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        gl.warp_specialize([
            (_idle, ()),
            (_loader, (w_desc, ring, ready, empty, pid, P, N, K, BN, BK, SUB, S, SWIGLU, PDL)),
            (_consumer, (x_desc, y_ptr, M, N, K, sym, ss_ptr, P_SS, eps, r_ptr, srm, g_ptr, xg_ptr, sso_ptr, x_ring,
                         x_ready, ring, ready, empty, pid, P, BN, BK, SUB, S, XS, RMS, SWIGLU, RESID, NEXT, P_PAD,
                         PDL)),
        ], [1, WARPS], [WORKER_REGS, WORKER_REGS])


def available() -> bool:
    return gluon is not None


_SMS: dict[int, int] = {}  # device index -> SM count, or 0 below sm_90


def _sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        major = torch.cuda.get_device_capability(index)[0]
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count if major >= 9 else 0
    return _SMS[index]


def block_k(k: int) -> int | None:
    """A slot's K columns for a weight of K columns: the largest of BKS that divides it, or None."""
    return next((b for b in BKS if k % b == 0), None)


def applies(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None) -> bool:
    """Whether skinny_gemm hands a call to this kernel: ENABLED, Gluon, CUDA on sm_90 or later, a bf16/fp16 weight
    of x's dtype (not fp8) whose rows are a multiple of 2 * BN (a SwiGLU weight's halves of BN), K a multiple of 64,
    and rows 16-byte aligned for TMA."""
    if not ENABLED or gluon is None or not x.is_cuda or w_scale is not None or w.dtype != x.dtype:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or not _sms(x.device):
        return False
    return (block_k(x.shape[1]) is not None and w.shape[0] % (2 * BN) == 0 and x.stride(0) % 8 == 0
            and w.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def _layout() -> object:
    """[rows, SUB] tiles in shared memory with a 128-byte swizzle (TMA writes it, ldmatrix reads it)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def launch_fused(x: torch.Tensor, w: torch.Tensor, ss: torch.Tensor | None, eps: float, swiglu: bool,
                 residual: torch.Tensor | None, g_next: torch.Tensor | None, pdl: bool, bk: int | None = None,
                 slots: int | None = None, x_slots: int = X_SLOTS
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """skinny_gemm.launch_fused's forms (its checks already made; `applies` true): x [M <= 16, K], w [N (2N for
    swiglu), K] -> (y, y * g_next, [M, N / BN] partial sums of y's squares) or (y, None, None). bk, slots,
    x_slots: the ring's shape (bench/chain_ws.py's sweep; `block_k`, SLOTS and X_SLOTS otherwise)."""
    m, k = x.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    tiles = n // BN
    y = x.new_empty((m, n))
    xg = torch.empty_like(y) if g_next is not None else None
    sso = torch.empty((m, tiles), dtype=torch.float32, device=x.device) if g_next is not None else None
    bk = bk or block_k(k)
    slots = slots or (SLOTS // 2 if swiglu else SLOTS)
    # descriptors made a call (a few microseconds of host time; captured once in a CUDA graph), so that none
    # outlives its tensor
    w_desc = TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [BN, SUB], _layout())
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [16, SUB], _layout())
    p_ss = ss.shape[1] if ss is not None else 1
    _ws_kernel[(min(_sms(x.device), tiles),)](
        w_desc, x_desc, y, m, n, k, y.stride(0), y if ss is None else ss, p_ss, float(eps),
        y if residual is None else residual, 0 if residual is None else residual.stride(0),
        y if g_next is None else g_next, y if xg is None else xg, y if sso is None else sso,
        BN=BN, BK=bk, SUB=SUB, S=slots, XS=x_slots, RMS=ss is not None, SWIGLU=swiglu,
        RESID=residual is not None, NEXT=g_next is not None, P_PAD=max(16, triton.next_power_of_2(p_ss)),
        PDL=int(pdl), WARPS=WARPS, WORKER_REGS=WORKER_REGS, num_warps=IDLE_WARPS, maxnreg=128,
        launch_pdl=pdl)
    return y, xg, sso

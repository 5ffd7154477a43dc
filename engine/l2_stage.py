"""Stage the first columns of a decode layer's weights in the GPU's L2 while its memory would idle.

In a one-token decode at small batches, a layer's attention and its combine hold the critical path for several
microseconds in which almost no bytes stream (docs/results.md, issue 23's timeline): the few-row projections
after them cannot start before the attention's output exists. A kernel on a side stream, launched after the QKV
projection, asks the L2 for the first `bytes a row` of each row of the weights that follow
(`cp.async.bulk.prefetch.L2`: the copy engine fetches into the L2, nothing comes to the SM and nothing waits on
it), so those projections' pipelines start from the L2. A prefetch is a hint: no value and no bit changes, and
the main stream never waits for the side one before the forward's end (`join`).

STAGE maps a weight's role in the layer ("o_proj", "gate_up", "down") to the bytes of each of its rows to stage;
empty, nothing runs. A GPU only (PTX); elsewhere `stage` does nothing.
"""
from __future__ import annotations

import threading

import torch

from flashpd.engine.triton_env import INTERPRET, tl, triton

STAGE: dict[str, int] = {}  # role -> bytes a row staged (a multiple of 16); {} off
EVICT_LAST = False  # the prefetched lines carry an evict-last L2 policy
ROWS_A_PROGRAM = 128

# a side stream a thread and device (two threads capturing graphs at once must not share one), and the devices whose
# side stream has work the thread's current stream has not yet joined
_local = threading.local()


def _state() -> tuple[dict[int, torch.cuda.Stream], set[int]]:
    if not hasattr(_local, "side"):
        _local.side, _local.pending = {}, set()
    return _local.side, _local.pending

if triton is not None:
    _PREFETCH = tl.constexpr("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;")
    _PREFETCH_LAST = tl.constexpr(
        "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
        "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }")

    @triton.jit
    def _stage_kernel(w_ptr, rows, row_bytes, chunk, BLOCK: tl.constexpr, LAST: tl.constexpr):
        """One bulk prefetch of `chunk` bytes at the start of each of BLOCK rows."""
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        base = w_ptr.to(tl.pointer_type(tl.int8))
        at = base + tl.where(r < rows, r, 0).to(tl.int64) * row_bytes
        size = tl.full([BLOCK], 0, tl.int32) + chunk
        if LAST:
            tl.inline_asm_elementwise(_PREFETCH_LAST, "=r,l,r", [at.to(tl.int64), size], dtype=tl.int32,
                                      is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_PREFETCH, "=r,l,r", [at.to(tl.int64), size], dtype=tl.int32,
                                      is_pure=False, pack=1)


ROLES = ("o_proj", "gate_up", "down")


def parse(spec: str) -> dict[str, int]:
    """"role:bytes,..." (roles of ROLES, bytes a positive multiple of 16) -> a STAGE map; "" -> {}."""
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        role, _, n = item.partition(":")
        if role not in ROLES or role in out:
            raise ValueError(f"l2 stage {item!r}: a role is one of {', '.join(ROLES)}, each once")
        if not n.isdigit() or int(n) <= 0 or int(n) % 16:
            raise ValueError(f"l2 stage {item!r}: bytes a row must be a positive multiple of 16")
        out[role] = int(n)
    return out


def active(x: torch.Tensor) -> bool:
    """Whether `stage` runs for a forward on x's device: STAGE set, CUDA with triton, not the interpreter."""
    return bool(STAGE) and triton is not None and not INTERPRET and x.is_cuda


def stage(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> None:
    """Launch, on the device's side stream after the work queued so far, the prefetch of STAGE's bytes of each
    named weight's rows (names STAGE does not list are skipped). Call `join` before the forward returns."""
    if not active(x):
        return
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    sides, pending = _state()
    cur = torch.cuda.current_stream(dev)
    side = sides.get(dev)
    if side is None:
        side = sides[dev] = torch.cuda.Stream(dev)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for role, w in weights.items():
            nbytes = STAGE.get(role, 0)
            if nbytes <= 0 or not isinstance(w, torch.Tensor):
                continue
            row_bytes = w.stride(0) * w.element_size()
            chunk = min(nbytes, row_bytes) // 16 * 16
            if chunk:
                _stage_kernel[(triton.cdiv(w.shape[0], ROWS_A_PROGRAM),)](
                    w, w.shape[0], row_bytes, chunk, BLOCK=ROWS_A_PROGRAM, LAST=EVICT_LAST, num_warps=4)
    pending.add(dev)


def join(x: torch.Tensor) -> None:
    """Make x's current stream wait for the side stream's prefetches (a CUDA graph's capture must join every
    stream it forked)."""
    if not x.is_cuda:
        return
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    sides, pending = _state()
    if dev in pending:
        torch.cuda.current_stream(dev).wait_stream(sides[dev])
        pending.discard(dev)

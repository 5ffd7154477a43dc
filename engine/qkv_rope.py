"""A decode's or verify's q/k norms, RoPE, query layout and K/V cache write: one Triton kernel after the QKV matmul.

Compiled, `qwen3.attn_inputs` left these to inductor as two kernels a layer: one for the queries (their norm, RoPE
and the kv-major layout the paged kernel reads) and one for the keys and values (the key's norm and RoPE, and the
scatter of both into the cache's slots); their shapes differ (32 query heads, 8 KV heads at Qwen3-8B), so inductor
does not fuse them. Here one program takes one token and one KV head: the head's G query heads, its key and its
value, all read from the same row of the QKV matmul's output. That is one launch a layer fewer, in every decode
step, verify and draft pass on the paged path (qwen3.fused_attn_inputs, called eagerly).

The arithmetic is `attn_inputs`' (layers.rms_norm: the mean square in fp32, the normed row cast to the input's
dtype before the weight; layers.apply_rotary), in fp32 from the loads to the stores. A token's bits depend on that
token's row only (a program per token and head, fixed tile shapes and warps), whatever else shares the call, so a
verify's tokens get the bits a one-token decode gets. They are not the eager or inductor bits of the same formula
(the sums run in another order): a cache holds this kernel's keys for every decoded or verified token, and the
fresh prefill's keys (inductor's) for the prompt, on every path alike.
"""
from __future__ import annotations

import torch

from flashpd.engine import triton_env
from flashpd.engine.triton_env import INTERPRET, tl, triton  # triton None: attn_inputs' plain steps only
if triton is not None:
    from flashpd.engine.triton_env import pdl_enter

NUM_WARPS = 1  # a program holds (G + 2) x d values (768 at Qwen3-8B): one warp; fixed, so no bit depends on it
ENABLED = True  # off: attn_inputs keeps inductor's kernels everywhere (an A/B in bench/speed_8b; other bits)
# On: qwen3.fused_layer (a decode, verify or draft pass of at most 16 rows) does this kernel's work inside the paged
# attention's launch (paged_attention.paged_attention_rope: one launch a layer fewer), and this kernel, which the
# other calls still take, sums the mean squares in `norm_rope`'s fixed order so that both kernels give a token the
# same bits (other bits than off's). On by default: one launch a layer fewer, measured faster at batch 1 on the H200
# (docs/results.md, issue 23; bench/speed_8b --rope-in-attention off for the A/B).
IN_ATTENTION = True


def available() -> bool:
    return triton is not None


def applies(x: torch.Tensor, n_q: int, n_kv: int, d: int) -> bool:
    """Whether the kernel takes QKV rows x: triton on CUDA (or the interpreter, on the CPU), a float dtype, a
    power-of-two head dim of 16 or more and a power-of-two number of query heads per KV head."""
    if not ENABLED or triton is None or not (x.is_cuda or INTERPRET):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    g = n_q // n_kv
    return n_q % n_kv == 0 and d >= 16 and d & (d - 1) == 0 and g & (g - 1) == 0


if triton is not None:
    @triton.jit
    def _norm_rope(x1, x2, w1, w2, cos1, cos2, sin1, sin2, eps, D: tl.constexpr, DT: tl.constexpr):
        """Rows of one head, each as its two halves x1, x2 [R, D/2] in fp32: rms_norm (the normed row rounded to
        the input dtype DT, then the weight), then RoPE (x * cos + rotate_half(x) * sin). The mean square is a
        tl.sum: its order follows this kernel's layout (IN_ATTENTION off)."""
        ms = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D
        r = 1.0 / tl.sqrt(ms + eps)
        y1 = w1[None, :] * (x1 * r[:, None]).to(DT).to(tl.float32)
        y2 = w2[None, :] * (x2 * r[:, None]).to(DT).to(tl.float32)
        return y1 * cos1[None, :] - y2 * sin1[None, :], y2 * cos2[None, :] + y1 * sin2[None, :]

    @triton.jit
    def norm_rope(base, cs, cos_ptr, sin_ptr, w_ptr, eps, ok, D: tl.constexpr, DT: tl.constexpr):
        """Rows of one head -> [R, D] in fp32: rms_norm (the normed row rounded to the input dtype DT, then the
        weight), then RoPE (x * cos + rotate_half(x) * sin). base [R]: each row's first value; cs [R]: its RoPE
        row's offset in cos/sin; ok [R]: rows to read (the others give zeros).

        Every step is elementwise but the mean square, whose order of additions is fixed by construction: SUMS
        running sums (explicit FMAs), sum i taking columns i, i + SUMS, ... in turn, then added pairwise in a fixed
        tree (tl.split). A tl.sum would add the squares in an order that follows the tensor's layout, which the
        compiler picks per kernel and tile shape, and this function runs in two kernels (this module's and the
        paged attention's, engine/paged_attention.py) whose bits must agree."""
        dd = tl.arange(0, D)
        pd = (dd + D // 2) % D  # rotate_half's partner column
        SUMS: tl.constexpr = 8
        part = tl.zeros([base.shape[0], SUMS], tl.float32)
        for c in tl.static_range(0, D, SUMS):
            xc = tl.load(base[:, None] + (c + tl.arange(0, SUMS))[None, :], mask=ok[:, None], other=0.0)
            xc = xc.to(tl.float32)
            part = tl.fma(xc, xc, part)
        a, b = tl.split(tl.reshape(part, [base.shape[0], SUMS // 2, 2]))
        a, b = tl.split(tl.reshape(a + b, [base.shape[0], SUMS // 4, 2]))
        a, b = tl.split(a + b)
        r = 1.0 / tl.sqrt((a + b) / D + eps)
        x = tl.load(base[:, None] + dd[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        xr = tl.load(base[:, None] + pd[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        y = tl.load(w_ptr + dd).to(tl.float32)[None, :] * (x * r[:, None]).to(DT).to(tl.float32)
        yr = tl.load(w_ptr + pd).to(tl.float32)[None, :] * (xr * r[:, None]).to(DT).to(tl.float32)
        cos = tl.load(cos_ptr + cs[:, None] + dd[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + cs[:, None] + dd[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        sign = tl.where(dd < D // 2, -1.0, 1.0)  # rotate_half(x) = (-x2, x1)
        return tl.fma(y, cos, (yr * sign[None, :]) * sin)

    @triton.jit
    def _qkv_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, T, eps,
                         s_qkv_b, s_qkv_t, s_cs_b, s_cs_t, sq_h, sq_b, sk_slot, sv_slot, NQ: tl.constexpr,
                         NKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DT: tl.constexpr,
                         PDL: tl.constexpr, FIXED: tl.constexpr):
        """Token `program_id(0)` (= b * T + t), KV head h = `program_id(1)`: its queries to q [NKV, B, T*G, D] at
        rows t*G .. t*G + G - 1 (attention.group_queries' layout), its key (normed, roped) and value to the
        cache's slot `slots[token]` ([slots, NKV, D] views). FIXED: `norm_rope` (IN_ATTENTION), else
        `_norm_rope`. PDL: see triton_env.pdl."""
        pdl_enter(PDL)
        tok = tl.program_id(0)
        h = tl.program_id(1)
        b = tok // T
        t = tok % T
        dd = tl.arange(0, D)
        j = tl.arange(0, G)
        row = qkv_ptr + b * s_qkv_b + t * s_qkv_t
        cs = b * s_cs_b + t * s_cs_t
        slot = tl.load(slot_ptr + tok)
        if FIXED:
            one = tl.arange(0, 1)
            v = tl.load(row + (NQ + NKV + h) * D + dd)
            q = norm_rope(row + (h * G + j) * D, cs + j * 0, cos_ptr, sin_ptr, wq_ptr, eps, j < G, D, DT)
            k = norm_rope(row + (NQ + h) * D + one, cs + one * 0, cos_ptr, sin_ptr, wk_ptr, eps, one < 1, D, DT)
            tl.store(q_ptr + h * sq_h + b * sq_b + (t * G + j)[:, None] * D + dd[None, :],
                     q.to(q_ptr.dtype.element_ty))
            tl.store(k_ptr + slot * sk_slot + h * D + one[:, None] * 0 + dd[None, :], k.to(k_ptr.dtype.element_ty))
            tl.store(v_ptr + slot * sv_slot + h * D + dd, v.to(v_ptr.dtype.element_ty))
        else:
            c = tl.arange(0, D // 2)
            # every load first: the stores below may alias them as far as the compiler knows, so a load after a
            # store waits for it; issued together, the program waits for memory once, not once a head (a decode
            # at batch 1 is 8 such programs, all latency)
            qrow = row + (h * G + j)[:, None] * D + c[None, :]
            krow = row + (NQ + h) * D + c[None, :]
            xq1 = tl.load(qrow).to(tl.float32)
            xq2 = tl.load(qrow + D // 2).to(tl.float32)
            xk1 = tl.load(krow).to(tl.float32)
            xk2 = tl.load(krow + D // 2).to(tl.float32)
            v = tl.load(row + (NQ + NKV + h) * D + dd)
            cos1 = tl.load(cos_ptr + cs + c).to(tl.float32)
            cos2 = tl.load(cos_ptr + cs + D // 2 + c).to(tl.float32)
            sin1 = tl.load(sin_ptr + cs + c).to(tl.float32)
            sin2 = tl.load(sin_ptr + cs + D // 2 + c).to(tl.float32)
            wq1 = tl.load(wq_ptr + c).to(tl.float32)
            wq2 = tl.load(wq_ptr + D // 2 + c).to(tl.float32)
            wk1 = tl.load(wk_ptr + c).to(tl.float32)
            wk2 = tl.load(wk_ptr + D // 2 + c).to(tl.float32)
            q1, q2 = _norm_rope(xq1, xq2, wq1, wq2, cos1, cos2, sin1, sin2, eps, D, DT)
            k1, k2 = _norm_rope(xk1, xk2, wk1, wk2, cos1, cos2, sin1, sin2, eps, D, DT)
            qout = q_ptr + h * sq_h + b * sq_b + (t * G + j)[:, None] * D + c[None, :]
            tl.store(qout, q1.to(q_ptr.dtype.element_ty))
            tl.store(qout + D // 2, q2.to(q_ptr.dtype.element_ty))
            kout = k_ptr + slot * sk_slot + h * D + c[None, :]
            tl.store(kout, k1.to(k_ptr.dtype.element_ty))
            tl.store(kout + D // 2, k2.to(k_ptr.dtype.element_ty))
            tl.store(v_ptr + slot * sv_slot + h * D + dd, v.to(v_ptr.dtype.element_ty))

    _DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @torch.library.custom_op("flashpd::qkv_rope_write", mutates_args=("k_slots", "v_slots"))
    def _qkv_rope_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_qn: torch.Tensor,
                     w_kn: torch.Tensor, eps: float, n_q: int, n_kv: int, k_slots: torch.Tensor,
                     v_slots: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b, t, _ = qkv.shape
        d = k_slots.shape[-1]
        g = n_q // n_kv
        q = torch.empty((n_kv, b, t * g, d), dtype=qkv.dtype, device=qkv.device)
        _qkv_rope_kernel[(b * t, n_kv)](
            qkv, cos, sin, w_qn, w_kn, slots, q, k_slots, v_slots, t, eps,
            qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), q.stride(0), q.stride(1), k_slots.stride(0),
            v_slots.stride(0),
            NQ=n_q, NKV=n_kv, G=g, D=d, DT=_DTYPES[qkv.dtype], FIXED=IN_ATTENTION, num_warps=NUM_WARPS,
            **triton_env.pdl_args(qkv.device, next_latency=True, tokens=t, rows=b * t))  # attention next
        return q

    @_qkv_rope_op.register_fake
    def _(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_qn: torch.Tensor, w_kn: torch.Tensor,
          eps: float, n_q: int, n_kv: int, k_slots: torch.Tensor, v_slots: torch.Tensor,
          slots: torch.Tensor) -> torch.Tensor:
        b, t, _ = qkv.shape
        d = k_slots.shape[-1]
        return qkv.new_empty((n_kv, b, t * (n_q // n_kv), d))


def qkv_rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_qn: torch.Tensor, w_kn: torch.Tensor,
                   eps: float, n_q: int, n_kv: int, k_slots: torch.Tensor, v_slots: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """qkv [B, T, (n_q + 2 n_kv) d] (the QKV matmul's output), cos/sin [B, T, d], the norms' weights [d], the
    layer's cache as [slots, n_kv, d] views, slots [B*T] -> queries [n_kv, B, T*G, d] (normed, roped, in the
    paged kernel's layout); each token's key (normed, roped) and value written at its slot. `applies` first."""
    d = k_slots.shape[-1]
    if triton is None:
        raise RuntimeError("qkv_rope_write needs triton")
    assert qkv.dim() == 3 and qkv.shape[-1] == (n_q + 2 * n_kv) * d and qkv.stride(-1) == 1
    assert cos.shape == sin.shape == (*qkv.shape[:2], d) and cos.stride() == sin.stride() and cos.stride(-1) == 1
    assert k_slots.shape[1:] == v_slots.shape[1:] == (n_kv, d)
    assert k_slots.stride()[1:] == (d, 1) == v_slots.stride()[1:]
    assert w_qn.is_contiguous() and w_kn.is_contiguous() and slots.is_contiguous()
    assert slots.numel() == qkv.shape[0] * qkv.shape[1]
    return torch.ops.flashpd.qkv_rope_write(qkv, cos, sin, w_qn, w_kn, float(eps), n_q, n_kv, k_slots, v_slots, slots)

"""Timing-only diagnosis: skip kernels of the batch-1 step (wrong data flow), then bench/speed_8b with the rest.
Variants: qkv (no qkv_rope kernel: q is an uninitialized buffer, no cache write), combine (split attention's
combine kernel not launched), attn (no paged attention call at all, its output an uninitialized buffer)."""
import sys
import torch
i = sys.argv.index("--")
skips = set(sys.argv[1:i])
from flashpd.engine import qkv_rope, paged_attention, qwen3
if "qkv" in skips:
    def fake_qkv(qkv, cos, sin, w_qn, w_kn, eps, n_q, n_kv, k_slots, v_slots, slots):
        b, t, _ = qkv.shape
        return torch.empty((n_kv, b, t * (n_q // n_kv), k_slots.shape[-1]), dtype=qkv.dtype, device=qkv.device)
    qkv_rope.qkv_rope_write = fake_qkv
if "combine" in skips:
    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *a, **k: None
    paged_attention._combine_kernel = _NoLaunch()
if "attn" in skips:
    def fake_attn(q, k_cache, v_cache, block_tables, positions, scale, heads_last=False, split=None):
        hkv, b, m, d = q.shape
        t = positions.shape[1]
        return q.new_empty((b, t, hkv * (m // t) * d)) if heads_last else torch.empty_like(q)
    qwen3.paged_attention = fake_attn
print("skips", sorted(skips), flush=True)
sys.argv = ["speed_8b"] + sys.argv[i + 1:]
from flashpd.bench import speed_8b
speed_8b.main()

"""Diagnosis wrapper: module.ATTR=int settings, blas=<lib>, noqkvrope=1 (timing only: a one-token call's
q/k norm + RoPE + cache-write kernel replaced by a view of the raw queries; the upper bound of fusing that kernel
into attention), then bench/speed_8b with the rest."""
import importlib, sys
import torch
i = sys.argv.index("--")
for a in sys.argv[1:i]:
    name, val = a.split("=")
    if name == "blas":
        torch.backends.cuda.preferred_blas_library(val)
        print("blas", torch.backends.cuda.preferred_blas_library(), flush=True)
        continue
    if name == "noqkvrope":
        from flashpd.engine import qkv_rope
        orig = qkv_rope.qkv_rope_write
        def fake(qkv, cos, sin, w_qn, w_kn, eps, n_q, n_kv, k_slots, v_slots, slots, _orig=orig):
            b, t, _ = qkv.shape
            if t != 1:
                return _orig(qkv, cos, sin, w_qn, w_kn, eps, n_q, n_kv, k_slots, v_slots, slots)
            d = k_slots.shape[-1]
            return qkv[:, 0, :n_q * d].view(b, n_kv, n_q // n_kv, d).permute(1, 0, 2, 3)
        qkv_rope.qkv_rope_write = fake
        print("noqkvrope: one-token qkv_rope skipped (timing only)", flush=True)
        continue
    mod, attr = name.rsplit(".", 1)
    m = importlib.import_module("flashpd.engine." + mod)
    assert hasattr(m, attr), a
    setattr(m, attr, int(val))
    print("set", name, "=", int(val), flush=True)
sys.argv = ["speed_8b"] + sys.argv[i + 1:]
from flashpd.bench import speed_8b
speed_8b.main()

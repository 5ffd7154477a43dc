"""Why test_qkv_rope's compiled case failed on the GPU: repeat it under a PDL setting, report what differs."""
import sys, json
sys.path.insert(0, sys.argv[1] + "/tests")
from flashpd.engine import triton_env
mode = sys.argv[2]
triton_env.PDL_ENABLED = mode != "off"
triton_env.PDL_LATENCY_RELEASE = {"off": 0, "on0": 0, "on1": 1, "on2": 2}[mode]
import torch
import test_qkv_rope as t
qr = t.KERNELS
res = []
for rep in range(int(sys.argv[3])):
    o = t.operands("cuda", torch.bfloat16, 2, 3, seed=9 + rep)
    def f(qkv, cos, sin, w_qn, w_kn, k_slots, v_slots, slots):
        return qr.qkv_rope_write(qkv, cos, sin, w_qn, w_kn, t.EPS, t.N_Q, t.N_KV, k_slots, v_slots, slots) * 2
    torch._dynamo.reset()
    cache = o["cache"].clone()
    out = torch.compile(f, fullgraph=True, backend="inductor")(o["qkv"], o["cos"], o["sin"], o["w_qn"], o["w_kn"],
                                                             cache[0], cache[1], o["slots"])
    torch.cuda.synchronize()
    q, ref = t.fused(qr, o)
    torch.cuda.synchronize()
    diff = (cache != ref)
    slots = o["slots"].tolist()
    bad = diff.any(-1).nonzero().tolist()  # [kv, slot, head]
    res.append({"rep": rep, "q_equal": bool(torch.equal(out, q * 2)), "cache_equal": bool(torch.equal(cache, ref)),
                "bad": bad[:12], "n_bad": len(bad), "written": slots,
                "untouched_equal_orig": bool(torch.equal(cache[:, [s for s in range(48) if s not in slots]],
                                                         o["cache"][:, [s for s in range(48) if s not in slots]])),
                "cache_equal_orig": bool(torch.equal(cache, o["cache"]))})
print(mode, json.dumps(res))

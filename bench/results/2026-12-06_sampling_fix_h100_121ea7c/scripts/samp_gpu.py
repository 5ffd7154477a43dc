"""GPU check of the sampling fix: uniforms and draws bitwise equal eager vs inductor on CUDA; one-hot draws
correct at Qwen3's vocabulary; the old formula's wrong-draw rate on the same seeds (for the record)."""
import json, sys, time
import torch
from flashpd.engine.sampling import _key, _mix, TOKEN, draw, uniforms, unit

dev = "cuda"
V, N = 151936, 2048
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "vocab": V}
seeds = torch.arange(N, dtype=torch.int64, device=dev) * 7919 - (1 << 40)
index = torch.randint(0, 40960, (N,), device=dev)

def old_uniforms(seed, index, stream, vocab):
    k = _key(seed, index, stream)
    v = torch.arange(vocab, dtype=torch.int64, device=k.device)
    k = _mix((k[..., None] + v * 0x27D4EB2F) & 0xFFFFFFFF)
    return ((k >> 8).float() + 0.5) * (1.0 / (1 << 24))

def old_draw(p, seed, index):
    return (p / -torch.log(old_uniforms(seed, index, TOKEN, p.shape[-1]))).argmax(-1)

cu = torch.compile(lambda s, i: uniforms(s, i, TOKEN, V), fullgraph=True)
cd = torch.compile(draw, fullgraph=True)
wrong_new = wrong_new_c = wrong_old = wrong_old_c = 0
u_equal = d_equal = True
umin, umax = 1.0, 0.0
cod = torch.compile(old_draw, fullgraph=True)
t0 = time.time()
for start in range(0, N, 128):
    s, i = seeds[start:start + 128], index[start:start + 128]
    ue, uc = uniforms(s, i, TOKEN, V), cu(s, i)
    u_equal &= bool(torch.equal(ue, uc))
    umin, umax = min(umin, ue.min().item()), max(umax, ue.max().item())
    hot = torch.randint(0, V, (s.shape[0],), device=dev)
    p = torch.zeros(s.shape[0], V, device=dev)
    p[torch.arange(s.shape[0], device=dev), hot] = 1.0
    te, tc = draw(p, s, i), cd(p, s, i)
    d_equal &= bool(torch.equal(te, tc))
    wrong_new += int((te != hot).sum()); wrong_new_c += int((tc != hot).sum())
    wrong_old += int((old_draw(p, s, i) != hot).sum()); wrong_old_c += int((cod(p, s, i) != hot).sum())
# a softmax distribution too: eager vs compiled draws equal
logits = torch.randn(256, V, device=dev) * 3
p = torch.softmax(logits / 0.7, -1)
d_equal_soft = bool(torch.equal(draw(p, seeds[:256], index[:256]), cd(p, seeds[:256], index[:256])))
out.update(draws=N, uniforms_eager_equal_compiled=u_equal, draws_eager_equal_compiled_onehot=d_equal,
           draws_eager_equal_compiled_softmax=d_equal_soft, u_min=umin, u_max=umax,
           onehot_wrong_new_eager=wrong_new, onehot_wrong_new_compiled=wrong_new_c,
           onehot_wrong_old_eager=wrong_old, onehot_wrong_old_compiled=wrong_old_c,
           expected_old_wrong=N * (V - 1) / 2 ** 24, seconds=time.time() - t0)
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"), indent=1)

"""GPU check of the uniforms' third form and top-p's kept set (36th session): eager vs inductor, the tail's
fairness and the flat distribution's ties against the earlier forms, top-p kept sets across shapes and compile."""
import json, sys, time
import torch
from flashpd.engine.sampling import TOKEN, _key, _mix, draw, entry_keys, filtered_probs, uniforms, unit

dev, V = "cuda", 151936
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "vocab": V}
t0 = time.time()

def old_entry(k, vocab):
    v = torch.arange(vocab, dtype=torch.int64, device=k.device)
    return _mix((k[..., None] + v * 0x27D4EB2F) & 0xFFFFFFFF)

def e_form(form, seed, index):
    k = _key(seed, index, TOKEN)
    if form == "new":
        return (-torch.log1p(-unit(entry_keys(k, V)))).clamp_min(1e-30)
    k = old_entry(k, V)
    if form == "24bit":
        return -torch.log(((k >> 8).float() + 0.5) * (1.0 / (1 << 24)))
    return -torch.log(((k >> 9).float() + 0.5) * (1.0 / (1 << 23)))  # 23bit

# 1. eager vs compiled, new form
cu = torch.compile(lambda s, i: uniforms(s, i, TOKEN, V), fullgraph=True)
cd = torch.compile(draw, fullgraph=True)
N = 2048
seeds = torch.arange(N, dtype=torch.int64, device=dev) * 7919 - (1 << 40)
index = torch.randint(0, 40960, (N,), device=dev, generator=torch.Generator(dev).manual_seed(0))
ueq = deq = True; wrong = wrong_c = 0
for st in range(0, N, 128):
    s, i = seeds[st:st + 128], index[st:st + 128]
    ueq &= bool(torch.equal(uniforms(s, i, TOKEN, V), cu(s, i)))
    hot = torch.randint(0, V, (s.shape[0],), device=dev)
    p = torch.zeros(s.shape[0], V, device=dev); p[torch.arange(s.shape[0], device=dev), hot] = 1.0
    te, tc = draw(p, s, i), cd(p, s, i)
    deq &= bool(torch.equal(te, tc)); wrong += int((te != hot).sum()); wrong_c += int((tc != hot).sum())
logits = torch.randn(256, V, device=dev) * 3
p = torch.softmax(logits / 0.7, -1)
out.update(onehot_draws=N, uniforms_eager_equal_compiled=ueq, onehot_draws_eager_equal_compiled=deq,
           onehot_wrong_eager=wrong, onehot_wrong_compiled=wrong_c,
           softmax_draws_eager_equal_compiled=bool(torch.equal(draw(p, seeds[:256], index[:256]),
                                                             cd(p, seeds[:256], index[:256]))))
print("1 done", time.time() - t0, flush=True)

# 2. the tail: one head token, every other at 1e-8 (mass 1.52e-3); 3. flat: ties for the least E
M = 1 << 16
tail = torch.full((V,), 1e-8, device=dev); tail[0] = 1 - 1e-8 * (V - 1)
for form in ("new", "23bit", "24bit"):
    hits = ties = 0
    for st in range(0, M, 256):
        s = torch.arange(st, st + 256, dtype=torch.int64, device=dev) + 12345
        i = torch.full((256,), 777, dtype=torch.int64, device=dev)
        e = e_form(form, s, i)
        hits += int(((tail / e).argmax(-1) != 0).sum())
        m = e.min(-1, keepdim=True).values
        ties += int(((e == m).sum(-1) > 1).sum())
    out[f"tail_hits_{form}"] = hits
    out[f"flat_ties_{form}"] = ties
out["tail_draws"] = M
out["tail_expected"] = M * 1e-8 * (V - 1)
print("2 done", time.time() - t0, flush=True)

# 4. top-p's kept set: eager [64, 8, V] vs compiled vs eager row by row; the old rule (float32 scan, unstable sort)
def old_keep(logits, top_p):
    scores = logits.float()
    ranked, order = scores.sort(dim=-1, descending=True)
    probs = torch.softmax(scores - scores.amax(-1, keepdim=True), -1)
    sp = probs.gather(-1, order)
    keep = sp.cumsum(-1) - sp < top_p.view(-1, 1, 1)
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep)

g = torch.Generator(dev).manual_seed(1)
L = (torch.randn(64, 8, V, device=dev, generator=g) * 2.5).bfloat16()
tp = torch.rand(64, device=dev, generator=g) * 0.98 + 0.01
one, zk = torch.ones(64, device=dev), torch.zeros(64, dtype=torch.int64, device=dev)
cf = torch.compile(filtered_probs, fullgraph=True)
new_e = filtered_probs(L, one, tp, zk) > 0
new_c = cf(L, one, tp, zk) > 0
new_r = torch.cat([filtered_probs(L[r:r + 1], one[r:r + 1], tp[r:r + 1], zk[r:r + 1]) > 0 for r in range(64)])
old_full = old_keep(L, tp)
old_c = torch.compile(old_keep, fullgraph=True)(L, tp)
old_r = torch.cat([old_keep(L[r:r + 1], tp[r:r + 1]) for r in range(64)])
diff = lambda a, b: int((a != b).any(-1).sum())
out.update(topp_rows=64 * 8, topp_new_eager_vs_compiled=diff(new_e, new_c), topp_new_eager_vs_rowwise=diff(new_e, new_r),
           topp_old_eager_vs_compiled=diff(old_full, old_c), topp_old_eager_vs_rowwise=diff(old_full, old_r),
           seconds=time.time() - t0)
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"), indent=1)

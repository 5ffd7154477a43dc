"""Diag: where a chunked 2,048-token prefill's time goes at the 8B shape; torch's flash varlen op here."""
import time, torch, statistics
from torch.profiler import profile, ProfilerActivity
print(torch.__version__, torch.ops.aten._flash_attention_forward.default._schema, flush=True)
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.generate import NativeGenerator
from flashpd.bench.profile_step import measure_prefill, kernel_table
cfg = load_config(builtin_config_path("qwen3-8b"))
target = dummy_target(cfg, "cuda", torch.bfloat16)
runner = ModelRunner(target, num_blocks=2048 // 16 * 4 + 64, kv_block_size=16)
gen = NativeGenerator(runner, ())
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, cfg.vocab_size, (2048,), generator=g).tolist()
for chunk in (1024, 2048, 512):
    runner.reconfigure(prefill_chunk=chunk, prefill_graph_tokens=chunk)
    print("chunk", chunk, "ms", round(measure_prefill(gen, prompt, 5, cuda=True), 2), flush=True)
runner.reconfigure(prefill_chunk=1024, prefill_graph_tokens=1024)
from flashpd.bench.profile_step import _ready
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    seqs = _ready(gen, prompt, 1); torch.cuda.synchronize()
gen.finish(seqs[0])
ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
tot = {}
for e in ev:
    k = e.name[:90]
    n, us = tot.get(k, (0, 0.0)); tot[k] = (n + 1, us + e.device_time)
print("busy ms", round(sum(v[1] for v in tot.values()) / 1e3, 2))
for k, (n, us) in sorted(tot.items(), key=lambda x: -x[1][1])[:25]:
    print(f"{us/1e3:9.3f} ms {n:5d}  {k}")
# varlen flash in a graph, bottom-right causal
hq, hk, d, L, T = 32, 8, 128, 2048, 1024
q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(L, hk, d, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
cq = torch.tensor([0, T], device="cuda", dtype=torch.int32); ck = torch.tensor([0, L], device="cuda", dtype=torch.int32)
def fa():
    return torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, T, L, 0.0, True, False, scale=d ** -0.5)[0]
o = fa()
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
      v.transpose(0, 1)[None], attn_mask=(torch.arange(L, device="cuda")[None] <= torch.arange(T, device="cuda")[:, None] + (L - T)),
      enable_gqa=True, scale=d ** -0.5)[0].transpose(0, 1)
print("fa vs sdpa lower-right max err", (o.float() - ref.float()).abs().max().item())
try:
    used = torch.tensor([1500], device="cuda", dtype=torch.int32)
    o2 = torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, T, L, 0.0, True, False, scale=d ** -0.5, seqused_k=used)[0]
    ref2 = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k[:1500].transpose(0, 1)[None],
      v[:1500].transpose(0, 1)[None], attn_mask=(torch.arange(1500, device="cuda")[None] <= torch.arange(T, device="cuda")[:, None] + (1500 - T)),
      enable_gqa=True, scale=d ** -0.5)[0].transpose(0, 1)
    print("seqused_k err", (o2.float() - ref2.float()).abs().max().item())
except Exception as e:
    print("seqused_k failed", repr(e)[:300])
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    fa()
torch.cuda.current_stream().wait_stream(s)
gr = torch.cuda.CUDAGraph()
with torch.cuda.graph(gr):
    og = fa()
gr.replay(); torch.cuda.synchronize()
print("graph ok", (og - o).abs().max().item())
for _ in range(3): gr.replay()
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(100): gr.replay()
torch.cuda.synchronize(); print("fa 1024x2048 us", (time.perf_counter() - t) * 1e4)

"""Where a prefill worker's 128-token prefill time goes on the H200 (diagnosis, not a bench)."""
import statistics, time, torch, sys
from flashpd.engine.factory import load_engine
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.warmup import lengths_for, warm_prefill, random_prompts
from flashpd.prefill_node.worker import PrefillWorker

p = load_engine(".dummy8b/target", ".dummy8b/drafter", "cuda", "bfloat16", 65536)
w = PrefillWorker(p.runner, p.drafter, None, tuple(p.stop_ids))
print("warm", warm_prefill(w.gen, lengths_for(p.runner.max_positions, 1)), flush=True)
nat = NativeGenerator(p.runner, tuple(p.stop_ids))
prompts = random_prompts([128] * 40, p.model.cfg.vocab_size, seed=1)
sp = lambda: SamplingParams(max_tokens=32, ignore_eos=True)
def med(xs): return round(statistics.median(xs), 3)
# 1: the worker's prefill as the service calls it
ts = []
for pr in prompts:
    torch.cuda.synchronize(); t = time.perf_counter(); r = w.prefill(pr, sp()); ts.append((time.perf_counter() - t) * 1e3)
print("worker.prefill (dflash gen, no exporter) ms", med(ts[5:]), "its prefill_ms", flush=True)
# 2: phases
for name, gen in (("dflash", w.gen), ("native", nat)):
    a, b, c, g = [], [], [], []
    for pr in prompts:
        torch.cuda.synchronize()
        t0 = time.perf_counter(); seq = gen.new_sequences([pr], [sp()])[0]; gen.reserve([seq]); t1 = time.perf_counter()
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True); e0.record()
        gen.prefill_request([seq]); e1.record(); t2 = time.perf_counter()
        gen.runner.allocator.free(seq.table); t3 = time.perf_counter()
        torch.cuda.synchronize(); a.append((t1-t0)*1e3); b.append((t2-t1)*1e3); c.append((t3-t2)*1e3); g.append(e0.elapsed_time(e1))
    print(name, "setup", med(a[5:]), "prefill_request(+first token)", med(b[5:]), "free", med(c[5:]), "gpu span", med(g[5:]), flush=True)
    # deferred first token (the colocated start path's prefill half)
    b, g = [], []
    for pr in prompts:
        seq = gen.new_sequences([pr], [sp()])[0]; gen.reserve([seq]); torch.cuda.synchronize()
        t1 = time.perf_counter(); first = []
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True); e0.record()
        gen.prefill_request([seq], defer=first); e1.record(); tok = first[0].tolist(); t2 = time.perf_counter()
        gen.runner.allocator.free(seq.table); torch.cuda.synchronize(); b.append((t2-t1)*1e3); g.append(e0.elapsed_time(e1))
    print(name, "deferred prefill + read", med(b[5:]), "gpu span", med(g[5:]), flush=True)
# 3: profile one worker prefill
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for pr in prompts[:5]:
        w.prefill(pr, sp())
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)

"""Diag: continued_sdpa on the GPU. (1) the op against SDPA with an explicit bottom-right mask, bf16, with padding;
(2) at the 8B shape: chunked prefill by length, continued form on/off (off: the gathered masked form), and the
last-token logits of a chunked prefill against one forward; (3) the demo pair: greedy tokens after a chunked
prefill (chunk 64) against one forward, continued on and off."""
import json, sys, torch
from flashpd.engine import attention
from flashpd.engine.cuda_graph import GraphedFn
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.generate import NativeGenerator
from flashpd.bench.profile_step import measure_prefill
R = sys.argv[1]
res = {}
# (1) the op
g = torch.Generator(device="cuda").manual_seed(0)
hq, hkv, d, bs = 32, 8, 128, 16
for prefix, real, t in ((1024, 1024, 1024), (3000, 700, 1024), (17, 100, 128)):
    nblk = (prefix + t) // bs + 4
    kc = torch.randn(nblk + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nblk, device="cuda")[None] + 1
    pos = torch.zeros(1, t, dtype=torch.int64, device="cuda"); pos[0, :real] = torch.arange(prefix, prefix + real, device="cuda")
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out = attention.continued_sdpa(q, kc, vc, bt, pos, d ** -0.5)
    k = kc[bt[0]].reshape(-1, hkv, d)[:prefix + real]; v = vc[bt[0]].reshape(-1, hkv, d)[:prefix + real]
    m = torch.arange(prefix + real, device="cuda")[None] <= torch.arange(real, device="cuda")[:, None] + prefix
    ref = torch.nn.functional.scaled_dot_product_attention(q[:real].transpose(0, 1).float(), k.transpose(0, 1).float(),
          v.transpose(0, 1).float(), attn_mask=m, enable_gqa=True, scale=d ** -0.5).transpose(0, 1).reshape(real, -1)
    err = (out[0, :real].float() - ref).abs().max().item()
    pad = out[0, real:].abs().max().item() if real < t else 0.0
    res.setdefault("op", []).append({"prefix": prefix, "real": real, "t": t, "max_err_vs_fp32": err, "padding_max": pad})
    print("op", prefix, real, t, "err", err, "pad", pad, flush=True)
# (2) 8B shape
cfg = load_config(builtin_config_path("qwen3-8b"))
target = dummy_target(cfg, "cuda", torch.bfloat16)
runner = ModelRunner(target, num_blocks=8192 // 16 * 3 + 64, kv_block_size=16)
gen = NativeGenerator(runner, ())
gp = torch.Generator().manual_seed(0)
rows = []
orig = attention.use_continued
import flashpd.engine.qwen3 as qwen3
for n in (2048, 4096, 8192):
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=gp).tolist()
    row = {"tokens": n}
    for name, on in (("continued", True), ("gathered", False)):
        qwen3.use_continued = orig if on else (lambda *a, **k: False)
        runner._graph = GraphedFn(runner._graphed)  # graphs are keyed by shape, not by form: capture anew
        runner.reconfigure(prefill_chunk=1024, prefill_graph_tokens=1024)
        row[f"chunks_1024_{name}_ms"] = measure_prefill(gen, prompt, 3, cuda=True)
    qwen3.use_continued = orig
    runner._graph = GraphedFn(runner._graphed)
    runner.reconfigure(prefill_chunk=None, prefill_graph_tokens=1024)
    row["one_forward_ms"] = measure_prefill(gen, prompt, 3, cuda=True)
    rows.append(row); print(row, flush=True)
res["prefill_8b"] = rows
json.dump(res, open("continued.json", "w"), indent=1)
del runner, gen, target; torch.cuda.empty_cache()
# (3) demo pair tokens
from flashpd.bench.speedup import heldout_prompt_sets, pair_generators
from flashpd.engine.tokenizer import TextTokenizer
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate
tgt, dr = f"{R}/flashpd/assets/demo_pair/target", f"{R}/flashpd/assets/demo_pair/drafter"
screen, confirm = heldout_prompt_sets(TextTokenizer.from_dir(tgt), 8, 0)
prompts = screen + confirm
params = [SamplingParams(max_tokens=64, ignore_eos=True)]
runner, native, spec = pair_generators(tgt, dr, "cuda")
out = {}
for name, chunk, on in (("one", None, True), ("chunk64_continued", 64, True), ("chunk64_gathered", 64, False)):
    qwen3.use_continued = orig if on else (lambda *a, **k: False)
    runner._graph = GraphedFn(runner._graphed)
    runner.reconfigure(prefill_chunk=chunk, prefill_graph_tokens=1024)
    out[name] = {"native": [generate(native, [p], params)[0].output for p in prompts],
                 "dflash": [generate(spec, [p], params, [16])[0].output for p in prompts]}
qwen3.use_continued = orig
lens = [len(p) for p in prompts]
for name in ("chunk64_continued", "chunk64_gathered"):
    for m in ("native", "dflash"):
        eq = sum(a == b for a, b in zip(out[name][m], out["one"][m]))
        print(name, m, "equal to one forward", eq, "/", len(prompts), flush=True)
        res.setdefault("demo_pair_tokens", {})[f"{name}_{m}"] = f"{eq}/{len(prompts)}"
    eq = sum(a == b for a, b in zip(out[name]["native"], out[name]["dflash"]))
    res["demo_pair_tokens"][f"{name}_dflash_equals_native"] = f"{eq}/{len(prompts)}"
    print(name, "dflash == native", eq, flush=True)
res["demo_pair_prompt_lens"] = lens
json.dump(res, open("continued.json", "w"), indent=1)

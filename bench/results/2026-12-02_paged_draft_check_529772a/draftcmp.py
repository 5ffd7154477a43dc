"""GPU check: DraftRunner.draft (the graphed, compiled stepwise path) paged vs gathered, demo pair, fp32 and bf16."""
import json, sys, torch
from flashpd.engine.factory import load_engine
from flashpd.engine.runner_config import RunnerConfig
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate

R = sys.argv[1]
out = {}
for dtype in ("float32", "bfloat16"):
    res = {}
    for impl in (None, "matmul"):
        p = load_engine(f"{R}/flashpd/assets/demo_pair/target", f"{R}/flashpd/assets/demo_pair/drafter", "cuda", dtype,
                        kv_cache_tokens=16384, runner_config=RunnerConfig(attention_impl=impl))
        gen = p.generator
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, 4000, (n,), generator=g).tolist() for n in (50, 300, 130)]
        widths = [16, 7, 3]
        seqs = gen.new_sequences(prompts, [SamplingParams(max_tokens=8, ignore_eos=True)] * 3)
        for s, w in zip(seqs, widths):
            p.runner.allocator.ensure(s.table, len(s.prompt) + w)
        feats = gen.prefill(seqs, taps=True)
        gen.drafts.write_prompt(seqs, feats)
        for s in seqs:
            s.output = [int(s.prompt[-1]) % 4000]
        a = gen.drafts.draft(seqs, widths).float().clone()
        b = gen.drafts.draft(seqs, widths).float().clone()  # a replay
        res[impl] = [a[i, :w - 1] for i, w in enumerate(widths)], [b[i, :w - 1] for i, w in enumerate(widths)]
        for s in seqs:
            p.runner.allocator.free(s.table)
        outs = generate(gen, prompts, [SamplingParams(max_tokens=48, ignore_eos=True)] * 3, [16] * 3)
        res[str(impl) + "_gen"] = [(s.output, s.stats.acceptance_lengths) for s in outs]
        print(dtype, impl, "paged" if gen.drafts.paged else "gathered", flush=True)
        del p, gen
        torch.cuda.empty_cache()
    rows = []
    for i in range(3):
        pa, pb = res[None][0][i], res[None][1][i]
        ga = res["matmul"][0][i]
        rows.append({"max_abs_diff": (pa - ga).abs().max().item(), "max_abs": ga.abs().max().item(),
                     "argmax_agree": (pa.argmax(-1) == ga.argmax(-1)).float().mean().item(),
                     "replay_equal": torch.equal(pa, pb)})
    gp, gg = res["None_gen"], res["matmul_gen"]
    out[dtype] = {"rows": rows, "tokens_equal": [x[0] == y[0] for x, y in zip(gp, gg)],
                  "tau_paged": [sum(x[1]) / len(x[1]) for x in gp], "tau_gathered": [sum(y[1]) / len(y[1]) for y in gg]}
    print(dtype, json.dumps(out[dtype]), flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)

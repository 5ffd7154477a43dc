"""bf16 parity with transformers on the GPU: logit error and greedy match rate (reported, not asserted).

    python -m flashpd.bench.hf_parity --out bench/results/hf_parity_bf16.json

A random Qwen3 (lm_head sharpened x8, as in the CPU tests) is built by transformers, saved, and
loaded by flashpd. Both run bf16 on the same GPU: logits at prefill are compared (max abs
and max abs relative to the logits' spread), and greedy continuations of several prompts are
compared token by token (first divergence reported). In bf16 a batched forward and a one-token
step round differently, so near-ties can flip: the match rate is the honest figure.
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from flashpd.bench.common import write_json
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.kv_cache import BlockTable
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate


def main() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/hf_parity_bf16.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=a.layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                      max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6)
    hf = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)
    d = tempfile.mkdtemp()
    hf.save_pretrained(d)
    hf = hf.to("cuda", torch.bfloat16).eval()
    ours = load_target(d, "cuda", torch.bfloat16)
    runner = ModelRunner(ours, num_blocks=4096, kv_block_size=16)
    gen = NativeGenerator(runner)
    lengths = [1 + (i * 97) % 600 for i in range(a.prompts)]
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in lengths]
    # Prefill logits against an fp32 reference: ours in bf16 and HF in bf16 should err alike, and
    # ours in fp32 (TF32 off) should match HF fp32 to float rounding.
    torch.backends.cuda.matmul.allow_tf32 = False
    hf32 = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32).to("cuda").eval()
    ours32 = load_target(d, "cuda", torch.float32)
    r32 = ModelRunner(ours32, num_blocks=256, kv_block_size=16, config=RunnerConfig(cuda_graphs=False))
    errs = []
    for p in prompts[:4]:
        x = torch.tensor([p], device="cuda")
        with torch.no_grad():
            ref = hf32(x).logits[0].float()
            hb = hf(x).logits[0].float()
        row = {"prompt_len": len(p), "logit_std": ref.std().item()}
        for name, r in (("ours_bf16", runner), ("ours_fp32", r32)):
            t = BlockTable()
            r.allocator.ensure(t, len(p))
            ol = r.forward([t], [p], "all").logits[0].float()
            r.allocator.free(t)
            row[name + "_vs_hf_fp32_max_abs"] = (ol - ref).abs().max().item()
            row[name + "_argmax_agree_hf_fp32"] = (ol.argmax(-1) == ref.argmax(-1)).float().mean().item()
            if name == "ours_bf16":
                row["ours_bf16_vs_hf_bf16_max_abs"] = (ol - hb).abs().max().item()
        row["hf_bf16_vs_hf_fp32_max_abs"] = (hb - ref).abs().max().item()
        row["hf_bf16_argmax_agree_hf_fp32"] = (hb.argmax(-1) == ref.argmax(-1)).float().mean().item()
        errs.append(row)
        print(row, flush=True)
    del hf32, ours32, r32
    seqs = generate(gen, prompts, [SamplingParams(max_tokens=a.new_tokens, ignore_eos=True)] * len(prompts))
    rows = []
    for p, s in zip(prompts, seqs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=a.new_tokens, do_sample=False,
                              min_new_tokens=a.new_tokens)[0, len(p):].tolist()
        first = next((i for i, (x, y) in enumerate(zip(ref, s.output)) if x != y), None)
        rows.append({"prompt_len": len(p), "exact": ref == s.output, "first_diff": first})
    exact = sum(r["exact"] for r in rows)
    print(f"greedy {a.new_tokens} tokens: exact {exact}/{len(rows)}; first diffs {[r['first_diff'] for r in rows if not r['exact']]}")
    write_json(a.out, {"bench": "hf_parity", "dtype": "bfloat16", "config": cfg.to_dict() | {"torch_dtype": "bfloat16"},
                       "logits": errs, "greedy": rows, "exact": f"{exact}/{len(rows)}",
                       "command": f"python -m flashpd.bench.hf_parity --layers {a.layers} --prompts {a.prompts} "
                                  f"--new-tokens {a.new_tokens} --out {a.out}"})


if __name__ == "__main__":
    main()

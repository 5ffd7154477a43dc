"""DFlash kernels at a real shape with dummy weights, and the loop replayed at a recorded tau.

    python -m flashpd.bench.dflash_step --config qwen3-8b --out bench/results/dflash_step.json \
        [--schedule bench/results/<recorded run>.json]

Measures, bf16, CUDA graphs: the target's 1-token decode step, its 16-token verify forward
(with the drafter's five taps), and one drafter block pass (16 positions, with the previous
step's 16 context rows written in the same pass). With --schedule, also runs whole requests
(native vs DFlash) where each step's accepted length is REPLAYED from a recorded run of a
trained pair: every kernel of the loop runs at the real shape, acceptance is borrowed. Rows
are labelled "replay"; their tokens are meaningless (dummy weights).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from flashpd.bench.common import summary, time_ms, write_json
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.drafter import DFlashConfig, dummy_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.kv_cache import BlockTable
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.sequence import Sequence
from flashpd.engine.spec_decode import DFlashGenerator, Seam
from flashpd.engine.scheduler import generate


def drafter_config_for(tcfg, layers: int = 5, block: int = 16) -> DFlashConfig:
    """The public Qwen3-8B-DFlash-b16 shape for any Qwen3 target."""
    from flashpd.engine.drafter import default_target_layer_ids
    return DFlashConfig(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size, num_hidden_layers=layers,
                        num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
                        head_dim=tcfg.head_dim, rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta,
                        block_size=block, num_target_layers=tcfg.num_hidden_layers,
                        target_layer_ids=tuple(default_target_layer_ids(tcfg.num_hidden_layers, layers)),
                        mask_token_id=151669 if tcfg.vocab_size > 151669 else tcfg.vocab_size - 1)


def kernel_times(model, drafter, context: int, reps: int, device: str = "cuda") -> dict:
    taps = tuple(drafter.cfg.target_layer_ids)
    runner = ModelRunner(model, num_blocks=(context + 64) // 16 + 16, kv_block_size=16, taps=taps)
    gen = DFlashGenerator(runner, drafter, (), 16)
    table = BlockTable()
    runner.allocator.ensure(table, context + 32)
    runner.forward([table], [[1] * context], "last")
    seq = Sequence([1] * context, SamplingParams(), frozenset())
    seq.table, seq.draft_len = table, context
    H = model.cfg.hidden_size

    def step():
        table.num_tokens = context
        runner.forward([table], [[2]], "last")

    def verify():
        table.num_tokens = context
        runner.forward([table], [[2] * 16], "all", taps=True)

    def draft():
        table.num_tokens = context
        seq.draft_len, seq.pending, seq.pending_rows = context - 16, torch.ones(16, len(taps) * H, dtype=model.embed_tokens.weight.dtype, device=device), 16
        gen.drafts.draft([seq], [16])

    out = {}
    for name, fn in (("target_step", step), ("verify16", verify), ("draft16", draft)):
        out[name] = summary(time_ms(fn, warmup=5, reps=reps, device=device))
        print(f"{name:12s} {out[name]['median_ms']:7.3f} ms", flush=True)
    out["verify16_over_step"] = out["verify16"]["median_ms"] / out["target_step"]["median_ms"]
    out["draft16_over_step"] = out["draft16"]["median_ms"] / out["target_step"]["median_ms"]
    return out


def replay(model, drafter, schedule: list[list[int]], prompt_lens: list[int], new_tokens: list[int], reps: int,
           device: str = "cuda") -> list[dict]:
    """Native vs DFlash latency per prompt, accepted lengths replayed from `schedule` (one list per prompt)."""
    taps = tuple(drafter.cfg.target_layer_ids)
    runner = ModelRunner(model, num_blocks=4096, kv_block_size=16, taps=taps)
    replayed = {"next": None}  # accepted drafts this step, from the recorded run being replayed
    # every kernel of the loop runs at the real shape, but the tokens are not the target's (dummy weights)
    seam = Seam(accepted=lambda s, w: replayed["next"]())
    native, spec = NativeGenerator(runner), DFlashGenerator(runner, drafter, (), 16, seam=seam)
    rows = []
    for n_new in new_tokens:
        for i, plen in enumerate(prompt_lens):
            sched = schedule[i % len(schedule)]
            it = None
            replayed["next"] = lambda: next(it) - 1  # recorded acceptance length = accepted drafts + 1
            prompt = [(7 * j + i) % 1000 + 10 for j in range(plen)]
            params = [SamplingParams(max_tokens=n_new, ignore_eos=True)]
            t_nat, t_spec, taus = [], [], []
            for r in range(reps + 1):  # first round is the warm-up
                it = itertools.cycle(sched)
                a = time_ms(lambda: generate(native, [prompt], params), warmup=0, reps=1, device=device)[0]
                box = {}
                b = time_ms(lambda: box.__setitem__("s", generate(spec, [prompt], params)), warmup=0, reps=1,
                            device=device)[0]
                if r:
                    t_nat.append(a)
                    t_spec.append(b)
                    taus.append(box["s"][0].stats.tau)
            m_nat, m_spec = statistics.median(t_nat), statistics.median(t_spec)
            rows.append({"label": "replay", "prompt_len": plen, "new_tokens": n_new, "native_ms": t_nat,
                         "dflash_ms": t_spec, "native_median_ms": m_nat, "dflash_median_ms": m_spec,
                         "speedup": m_nat / m_spec, "tau_replayed": statistics.mean(taus)})
            print(f"replay prompt {plen:5d} new {n_new:4d}: native {m_nat:8.1f} ms, dflash {m_spec:8.1f} ms, "
                  f"x{m_nat / m_spec:.2f} at tau {statistics.mean(taus):.2f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-8b", help="a builtin name or a config.json path")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-lens", default="128,512,2048")
    ap.add_argument("--new-tokens", default="64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--schedule", help="comma-separated JSON files with per-prompt acceptance_lengths of recorded "
                                       "greedy runs (bench/record_schedule.py)")
    ap.add_argument("--replay-reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results/dflash_step.json")
    a = ap.parse_args()
    cfg = load_config(a.config if a.config.endswith(".json") else builtin_config_path(a.config))
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = dummy_target(cfg, a.device, dtype)
    drafter = dummy_drafter(drafter_config_for(cfg), model)
    t_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    d_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters()) + model.head_weight.numel() * 2
    payload = {"bench": "dflash_step", "config": a.config, "dtype": str(dtype).removeprefix("torch."), "weights": "dummy",
               "target_bytes": t_bytes, "drafter_bytes_with_lm_head": d_bytes, "drafter_over_target_bytes": d_bytes / t_bytes,
               "context": a.context, "kernels": kernel_times(model, drafter, a.context, a.reps, a.device)}
    payload["replay"] = []
    write_json(a.out, payload)  # partial results survive a later timeout
    for path in a.schedule.split(",") if a.schedule else []:
        rec = json.load(open(path))
        schedule = [r["acceptance_lengths"] for r in rec.get("per_prompt") or rec["heldout"]]
        print(f"replaying {path} (tau {rec.get('tau_mean')}):", flush=True)
        payload["replay"].append({
            "schedule_file": path, "schedule_source": rec.get("source"), "schedule_tau": rec.get("tau_mean"),
            "rows": replay(model, drafter, schedule, [int(x) for x in a.prompt_lens.split(",")],
                           [int(x) for x in a.new_tokens.split(",")], a.replay_reps, a.device)})
        write_json(a.out, payload)
    payload["command"] = (f"python -m flashpd.bench.dflash_step --config {a.config} --context {a.context} --reps {a.reps}"
                          f" --prompt-lens {a.prompt_lens} --new-tokens {a.new_tokens}"
                          + (f" --schedule {a.schedule}" if a.schedule else "") + f" --out {a.out}")
    write_json(a.out, payload)
    k = payload["kernels"]
    print(f"verify16/step {k['verify16_over_step']:.3f}; draft16/step {k['draft16_over_step']:.3f} "
          f"(drafter bytes {d_bytes / t_bytes:.2f}x target)")


if __name__ == "__main__":
    main()

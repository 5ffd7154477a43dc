"""Native decode step at a real shape with dummy weights, against the memory-bandwidth floor.

    python -m flashpd.bench.native_step --config qwen3-8b --out bench/results/native_step.json

Floor = bytes of weights read per step / measured device-to-device copy rate (read + write).
A step is timed end to end through ModelRunner.forward (batch building, H2D copies, CUDA-graph
replay, logits), after a prompt of --context tokens per sequence.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from flashpd.bench.common import copy_bandwidth_gbs, summary, time_ms, write_json
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.kv_cache import BlockTable
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner, RunnerConfig



def main() -> None:

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="bench/results/native_step.json")
    a = ap.parse_args()

    cfg = load_config(builtin_config_path(a.config))
    model = dummy_target(cfg, "cuda", torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth_gbs()
    floor_ms = weight_bytes / (bw["gb_per_s"] * 1e9) * 1e3
    results = []
    for b in [int(x) for x in a.batches.split(",")]:
        for graphs in (True, False):
            runner = ModelRunner(model, num_blocks=b * (a.context // 16 + 64) + 8, kv_block_size=16,
                                 config=RunnerConfig(cuda_graphs=graphs))
            tables = [BlockTable() for _ in range(b)]
            for t in tables:
                runner.allocator.ensure(t, a.context + 512)
            runner.forward(tables, [[1] * a.context for _ in tables], "last")
            base = a.context

            def step() -> None:
                for t in tables:  # decode at a fixed length: roll back the token just written
                    t.num_tokens = base
                runner.forward(tables, [[2] for _ in tables], "last")

            samples = time_ms(step, warmup=5, reps=a.reps)
            med = statistics.median(samples)
            row = {"batch": b, "cuda_graphs": graphs, "context": a.context, "step": summary(samples),
                   "ms_per_step": med, "x_floor": med / floor_ms, "tokens_per_s": b / (med * 1e-3)}
            results.append(row)
            print(f"batch {b:3d} graphs={graphs!s:5}: {med:7.3f} ms/step = {med / floor_ms:5.2f}x floor "
                  f"({b / (med * 1e-3):8.0f} tok/s)", flush=True)
            del runner
            torch.cuda.empty_cache()
    payload = {"bench": "native_step", "config": a.config, "dtype": "bfloat16", "weights": "dummy",
               "weight_bytes": weight_bytes, "copy_bandwidth": bw, "floor_ms": floor_ms, "results": results,
               "command": f"python -m flashpd.bench.native_step --config {a.config} --batches {a.batches} "
                          f"--context {a.context} --reps {a.reps} --out {a.out}"}
    write_json(a.out, payload)
    print(f"floor {floor_ms:.3f} ms ({weight_bytes / 1e9:.2f} GB at {bw['gb_per_s']:.0f} GB/s); wrote {a.out}")


if __name__ == "__main__":
    main()

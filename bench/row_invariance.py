"""Where a decode's row parts, layer by layer, between one column and the verify's 16 (bf16, on a GPU).

    python -m flashpd.bench.row_invariance --prompts 0,5 --out bench/results/row_invariance.json

speed_8b's exactness compares DFlash with native decode at the verify's shapes (16 columns, 15 of them padding),
because native at one column parts on some prompts. This says where. For each prompt of the speedup protocol's
screen set, it prefills the prompt, then runs one decode step of its next token twice: once as [1, 1], once as
[1, 16] with the token and its position repeated (padding columns write the scratch block). It compares column
0's outputs bitwise: every decoder layer's output, the final normed hidden state, and the logits. It does this
under each function set: the layer functions eagerly; compiled as the runner compiles them by default
(`ModelRunner.compiled`); that with inductor's split reductions off; and that with intermediates rounded to their
dtype where eager rounds them (inductor's emulate_precision_casts: RunnerConfig.compile_eager_rounding). It
reports, per set, the first layer whose output differs, the largest difference at each layer, and which of layer
0's step functions (the embedding and RoPE lookup, the input norm, q/k/v, attention and MLP) already differ.
"""
from __future__ import annotations

import argparse

import torch

from flashpd.bench.common import write_json
from flashpd.bench.speedup import heldout_prompt_sets
from flashpd.demo import PAIR
from flashpd.engine.attention import AttnBatch
from flashpd.engine.loader import load_target
from flashpd.engine.qwen3 import EAGER, StepFns
from flashpd.engine.runner import ModelRunner
from flashpd.engine.runner_config import RunnerConfig
from flashpd.engine.tokenizer import TextTokenizer

BS = 16  # cache block size


def recording(fns: StepFns, log: list) -> StepFns:
    """fns, each call's name and output appended to `log` (in call order: layer 0's first)."""
    def wrap(name: str, f):
        def call(*args, **kw):
            out = f(*args, **kw)
            log.append((name, out))
            return out
        return call
    return StepFns(*(wrap(n, f) for n, f in zip(StepFns._fields, fns)))


def column0(name: str, out, groups: int) -> list[torch.Tensor]:
    """Column 0's rows of a step function's outputs (the layouts qwen3's functions return)."""
    if name == "step_inputs":  # h [B, T, H], cos, sin [B, T, d], mask
        return [out[0][0, 0], out[1][0, 0], out[2][0, 0]]
    if name == "attn_inputs":  # q [n_kv, B, T*G, d], k and v [B*T, n_kv, d]
        return [out[0][:, 0, :groups], out[1][0], out[2][0]]
    if name == "attn_mlp":  # h, x [B, T, H]
        return [out[0][0, 0], out[1][0, 0]]
    return [out[0, 0]]  # norm: x [B, T, H]


def first_calls_differing(one: list, wide: list, groups: int) -> list[str]:
    """Layer 0's functions (the first call of each name) whose column-0 outputs differ between the runs."""
    firsts = [{}, {}]
    for log, first in zip((one, wide), firsts):
        for name, out in log:
            first.setdefault(name, out)
    return [name for name in firsts[0] if name in firsts[1] and not all(
        torch.equal(a, b) for a, b in zip(column0(name, firsts[0][name], groups),
                                          column0(name, firsts[1][name], groups)))]


def step(model, kv: torch.Tensor, fns: StepFns, token: int, pos: int, width: int, nblk: int
         ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One decode of `token` at `pos` over the prompt's cache (blocks 1..nblk), `width` columns."""
    dev = kv.device
    ids = torch.full((1, width), token, device=dev)
    positions = torch.full((1, width), pos, device=dev)
    slots = torch.arange(width, device=dev)  # padding columns: the scratch block 0
    slots[0] = BS + pos  # the real column: its place after the prompt
    tables = torch.arange(1, nblk + 1, device=dev)[None]
    layers = tuple(range(len(model.layers)))
    out, hs = model.forward(ids, AttnBatch(positions, slots, tables), kv, taps=layers, fns=fns)
    return [h[0, 0] for h in hs], out[0, 0], model.logits(out[:, :1])[0, 0]


def probe(model, kv: torch.Tensor, fns: StepFns, prompt: list[int]) -> dict:
    dev = kv.device
    n = len(prompt)
    nblk = -(-(n + 1) // BS)
    ids = torch.tensor([prompt], device=dev)
    batch = AttnBatch(torch.arange(n, device=dev)[None], BS + torch.arange(n, device=dev),
                      torch.arange(1, nblk + 1, device=dev)[None], fresh=True)
    out, _ = model.forward(ids, batch, kv, fns=fns)
    token = int(model.logits(out[:, -1:]).argmax(-1))
    logs: tuple[list, list] = ([], [])
    one = step(model, kv, recording(fns, logs[0]), token, n, 1, nblk)
    wide = step(model, kv, recording(fns, logs[1]), token, n, 16, nblk)
    groups = model.cfg.num_attention_heads // model.cfg.num_key_value_heads
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(one[0], wide[0])]
    first = next((i for i, (a, b) in enumerate(zip(one[0], wide[0])) if not torch.equal(a, b)), None)
    return {"prompt_len": n, "first_layer_differing": first, "layer_max_abs_diff": diffs,
            "layer0_functions_differing": first_calls_differing(*logs, groups),
            "final_equal": torch.equal(one[1], wide[1]), "logits_equal": torch.equal(one[2], wide[2]),
            "logits_max_abs_diff": (one[2].float() - wide[2].float()).abs().max().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(PAIR / "target"))
    ap.add_argument("--prompts", default="0,1,2,3", help="indices into the protocol's screen set")
    ap.add_argument("--screen", type=int, default=8, help="prompts in the screen set (speed_8b's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/row_invariance.json")
    a = ap.parse_args()
    model = load_target(a.target, "cuda", torch.bfloat16)
    runner = ModelRunner(model, num_blocks=512, kv_block_size=BS, config=RunnerConfig(compile=True))

    def compiled(**config) -> StepFns:
        """The layer functions as a runner of this config compiles them (its own cache unused)."""
        return ModelRunner(model, num_blocks=2, kv_block_size=BS, config=RunnerConfig(compile=True, **config)).graph_fns

    sets = {"eager": EAGER, "compiled": runner.graph_fns,
            "compiled_no_split_reductions": compiled(inductor_extra=(("split_reductions", False),)),
            "compiled_eager_rounding": compiled(compile_eager_rounding=True)}
    screen, _ = heldout_prompt_sets(TextTokenizer.from_dir(a.target), a.screen, a.seed)
    results = {}
    for name, fns in sets.items():
        results[name] = {}
        for i in (int(p) for p in a.prompts.split(",")):
            with torch.no_grad():
                r = probe(model, runner.cache.data, fns, screen[i])
            results[name][str(i)] = r
            print(f"{name:34s} prompt {i} ({r['prompt_len']} tokens): first layer differing "
                  f"{r['first_layer_differing']} (layer 0: {r['layer0_functions_differing']}), logits equal "
                  f"{r['logits_equal']} (max {r['logits_max_abs_diff']:.3g})", flush=True)
    write_json(a.out, {"bench": "row_invariance", "command": "python -m flashpd.bench.row_invariance "
                       f"--target {a.target} --prompts {a.prompts} --screen {a.screen} --seed {a.seed}",
                       "results": results})


if __name__ == "__main__":
    main()

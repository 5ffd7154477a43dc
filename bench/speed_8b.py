"""Decode, DFlash and prefill speed at the Qwen3-8B shape against the GPU's own limits, and bf16 exactness, in one run.

    python -m flashpd.bench.speed_8b --out bench/results/speed_8b_h200.json

Every figure is a ratio of two things measured in this process (dummy weights of the real config, bf16, CUDA
graphs, torch.compile on):
- the floor of a decode step = (weight bytes + KV bytes read a step) / the device-to-device copy rate (bytes read
  plus written). Weight bytes are every parameter's (the floor the issue set its aims against); the floor of the
  bytes a step really reads (the embedding table once, not all of it) is reported beside it;
- native decode in the device loop (engine/device_loop.py: state on the device, the host one step behind), wall
  time per step over `--steps` steps after a `--context`-token prompt, at batch 1 to 256; batch 1 also under the
  profiler (GPU-busy time, kernels a step);
- the same batches through the serving scheduler (decode_node/scheduler.py);
- a DFlash width-16 step at batch 1 (a dummy drafter accepts about nothing: a step's cost, not a speedup);
- `--long-contexts`: batch-1 native and DFlash steps after longer prompts (section `long`; how attention over a long
  context moves both, reported apart from the issue's figures at `--context`);
- a fresh `--prefill-tokens` prefill against the bf16 matmul rate (an 8192-cube matmul) of this GPU;
- `--prefill-lengths` prompts prefilled in the runner's default chunks and as one forward (a long prompt's TTFT);
- exactness: DFlash against native on the speedup protocol's prompts (the demo pair, 256 new tokens, width 16),
  with native at the verify's kernel shapes (NativeGenerator.step_width) and, for reference, at one column.
The JSON is written after every section (a run cut short keeps what it measured). The copy rate is read again at
the end (`copy_bandwidth_end`), to show how far the reading the floors use can move.
"""
from __future__ import annotations

import argparse
import faulthandler
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashpd.bench.common import command_line, copy_bandwidth_gbs, time_ms, write_json
from flashpd.bench.dflash_step import drafter_config_for
from flashpd.bench.profile_step import kernel_table, measure_prefill
from flashpd.demo import PAIR
from flashpd.engine import qkv_rope, skinny_gemm, triton_env
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.engine.scheduler import Scheduler, generate


def log(msg: str) -> None:
    print(f"[speed_8b {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextmanager
def watched(name: str, res: dict, dump_s: float):
    """Time a section into res["section_s"]; if it runs past dump_s, every thread's Python stack goes to stderr
    (and again each dump_s), so a run that stalls says where (the first run's DFlash section stalled unseen)."""
    faulthandler.dump_traceback_later(dump_s, repeat=True, file=sys.stderr)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        res.setdefault("section_s", {})[name] = time.perf_counter() - t0


def matmul_tflops(n: int = 8192) -> float:
    """bf16 dense matmul rate of an n-cube product, TFLOP/s (median of 20)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / (statistics.median(time_ms(lambda: a @ b, warmup=5, reps=20)) * 1e-3) / 1e12


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def paged_agreement(target, prompts: list[list[int]]) -> dict:
    """One batched decode forward (the paged kernel and
    o_proj as one matmul) against the same forward through the gather path (attention_impl "matmul"), both
    eager, bf16: how far the logits differ and how often the argmax agrees (a wrong head order or a wrong
    key would show as disagreement far beyond bf16 rounding)."""
    out = []
    for impl in (None, "matmul"):
        r = ModelRunner(target, len(prompts) * (len(prompts[0]) // 16 + 2) + 2, 16,
                        config=RunnerConfig(cuda_graphs=False, compile=False, attention_impl=impl))
        gen = NativeGenerator(r, ())
        seqs = ready(gen, prompts, 2)
        for s in seqs:
            r.allocator.ensure(s.table, s.table.num_tokens + 1)
        out.append(r.forward([s.table for s in seqs], [[s.last_token] for s in seqs], "last").logits[:, -1].float())
        for s in seqs:
            r.allocator.free(s.table)
        del r, gen
    paged, gathered = out
    return {"batch": len(prompts), "max_abs_diff": (paged - gathered).abs().max().item(),
            "max_abs_logit": gathered.abs().max().item(),
            "argmax_agree": (paged.argmax(-1) == gathered.argmax(-1)).float().mean().item()}


def ready(gen: NativeGenerator, prompts: list[list[int]], max_tokens: int, width: int | None = None):
    seqs = gen.new_sequences(prompts, [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(prompts))
    for s in seqs:
        if width is not None:
            s.draft_width = width
    gen.reserve(seqs)
    gen.prefill_request(seqs)
    return seqs


def run_steps(loop, sess, n: int) -> None:
    """Launch n device-loop steps with the host one step behind (DeviceLoop.step_to_end's rhythm), read them all,
    and wait for the device."""
    for _ in range(n):
        loop.launch(sess)
        if len(sess.queued) == 2:
            loop.read(sess)
    while sess.queued:
        loop.read(sess)
    torch.cuda.synchronize()


def loop_steps(gen: NativeGenerator, prompts: list[list[int]], steps: int, width: int | None = None,
               profiled: bool = False) -> dict:
    """Wall ms per device-loop step over `steps` steps (after 3 untimed), the host one step behind as in
    `DeviceLoop.step_to_end`; with `profiled`, GPU-busy ms and kernels per step from a second, profiled pass."""
    budget = (steps + 8) * (width or 1)  # no row may finish inside the timed steps
    seqs = ready(gen, prompts, budget, width)
    loop = gen.loop()
    sess = loop.begin(seqs)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_steps(loop, sess, n)
        return (time.perf_counter() - t0) * 1e3 / n

    run(3)
    out = {"ms_per_step": run(steps), "steps": steps, "batch": len(prompts), "context_start": len(prompts[0]),
           # the mean context of the steps run so far (the timed ones dominate)
           "context_mean": len(prompts[0]) + statistics.mean(len(s.output) for s in seqs) / 2}
    if profiled:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(min(steps, 20))
        busy, kernels, table = kernel_table(prof, min(steps, 20))
        out.update(gpu_busy_ms_per_step=busy, kernels_per_step=kernels, top_kernels=table[:15])
    if width is not None:
        emitted = sum(len(s.output) for s in seqs)
        out["tokens_per_step"] = emitted / max(1, sess.launched)
    loop.end(sess)
    for s in seqs:
        gen.runner.allocator.free(s.table)
    return out


def scheduler_steps(runner: ModelRunner, batch: int, context: int, steps: int, vocab: int) -> dict:
    """Native decode of `batch` requests through the serving scheduler: wall ms per step once every request
    runs (admission and prefill excluded), timed over `steps` steps."""
    sched = Scheduler(runner, max_running=batch)
    params = SamplingParams(max_tokens=steps + 24, ignore_eos=True)
    for p in random_prompts(batch, context, vocab, seed=batch):
        sched.add(p, params, "native")
    while sched.waiting or len(sched.running) < batch:
        sched.step()
    for _ in range(3):
        sched.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    made = 0
    for _ in range(steps):
        made += sum(len(v) for v in sched.step().new_tokens.values())
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) * 1e3
    sched.run_until_idle()
    return {"batch": batch, "ms_per_step": dt / steps, "tokens_per_step": made / steps,
            "tokens_per_s": made / dt * 1e3, "steps": steps}


def prefill_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of a fresh prefill: every linear layer over every token, causal attention (QK^T and PV
    over the lower triangle), and the head for the last token only."""
    h, d, hq, hkv, i = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.intermediate_size
    per_token = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i
    attn = 2 * 2 * hq * d * tokens * (tokens + 1) / 2
    return cfg.num_hidden_layers * (2 * tokens * per_token + attn) + 2 * h * cfg.vocab_size


def exactness(target: str, draft: str, prompts: int, new_tokens: int, width: int, seed: int,
              device: str = "cuda", eager_rounding: bool = False, inductor_extra: tuple = (),
              blas: str | None = RunnerConfig.blas) -> dict:
    """DFlash against native, greedy, on the speedup protocol's prompts: native at the verify's shapes
    (step_width = width) and at one column. eager_rounding, inductor_extra and blas: the RunnerConfig fields."""
    from flashpd.bench.speedup import heldout_prompt_sets, pair_generators  # noqa: PLC0415
    from flashpd.engine.tokenizer import TextTokenizer  # noqa: PLC0415

    runner, native, spec = pair_generators(target, draft, device, eager_rounding=eager_rounding,
                                           inductor_extra=inductor_extra, blas=blas)
    screen, confirm = heldout_prompt_sets(TextTokenizer.from_dir(target), prompts, seed)
    params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True)]
    wide = NativeGenerator(runner, native.stop_ids, step_width=width)
    rows = []
    for i, p in enumerate(screen + confirm):
        d = generate(spec, [p], params, [width])[0].output
        n1 = generate(native, [p], params)[0].output
        nw = generate(wide, [p], params)[0].output
        first = next((k for k, (x, y) in enumerate(zip(d, nw)) if x != y), None)
        rows.append({"prompt": i, "prompt_len": len(p), "equal_at_verify_shapes": d == nw,
                     "equal_at_one_column": d == n1, "first_diff_at_verify_shapes": first})
        log(f"exact prompt {i}: verify shapes {d == nw}, one column {d == n1}")
    n = len(rows)
    return {"target": target, "draft": draft, "width": width, "new_tokens": new_tokens, "prompts": rows,
            "exact_verify_shapes": f"{sum(r['equal_at_verify_shapes'] for r in rows)}/{n}",
            "exact_one_column": f"{sum(r['equal_at_one_column'] for r in rows)}/{n}"}


def inductor_option(spec: str) -> tuple[str, bool | int | float | str]:
    """"combo_kernels=1" -> ("combo_kernels", 1): true/false as bools, numbers as numbers, else the string."""
    name, sep, value = spec.partition("=")
    if not sep or not name:
        raise SystemExit(f"--inductor-option takes NAME=VALUE, got {spec!r}")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    for cast in (int, float):
        try:
            return name, cast(value)
        except ValueError:
            pass
    return name, value


def fields(res: dict) -> dict:
    """The issue's top-level figures from the sections present."""
    out: dict = {}
    curve = {r["batch"]: r for r in res.get("native_curve", [])}
    if 1 in curve:
        out["native_b1_x_floor"] = curve[1]["ms_per_step"] / curve[1]["floor_ms"]
        out["native_b1_x_floor_bytes_read"] = curve[1]["ms_per_step"] / curve[1]["floor_ms_bytes_read"]
        out["native_b1_gpu_busy_ms"] = curve[1].get("gpu_busy_ms_per_step")
        out["native_b1_kernels_per_step"] = curve[1].get("kernels_per_step")
        out["native_step_ms_b1"] = curve[1]["ms_per_step"]
    for b in (32, 128):
        if b in curve:
            out[f"b{b}_floor_fraction"] = curve[b]["floor_fraction"]
    for r in res.get("scheduler", []):
        out[f"b{r['batch']}_scheduler_floor_fraction"] = r["floor_fraction"]
    if "dflash_b1" in res and 1 in curve:
        out["dflash_step_ms_b1"] = res["dflash_b1"]["ms_per_step"]
        out["dflash_over_native_step"] = res["dflash_b1"]["ms_per_step"] / curve[1]["ms_per_step"]
    for r in res.get("dflash_draft_vocab", []):  # labelled apart: a reduced draft vocabulary changes the guesses
        nb = curve.get(r["batch"])
        if nb is not None:
            key = f"dflash_over_native_step_b{r['batch']}_draft_vocab_{r['draft_vocab'] or 'full'}"
            out[key] = r["ms_per_step"] / nb["ms_per_step"]
    for r in res.get("dflash_draft_quant", []):  # labelled apart: the drafter's weights in another format
        nb = curve.get(r["batch"])
        if nb is not None:
            key = (f"dflash_over_native_step_b{r['batch']}_draft_{r['draft_quantization']}"
                   f"_vocab_{r['draft_vocab'] or 'full'}")
            out[key] = r["ms_per_step"] / nb["ms_per_step"]
    for r in res.get("by_context", []):  # labelled apart: the figures are at --context
        out[f"dflash_over_native_step_b1_ctx{r['context']}"] = r["dflash"]["ms_per_step"] / r["native"]["ms_per_step"]
    if "native_b1_verify_shapes" in res and 1 in curve:
        out["verify_shapes_cost"] = res["native_b1_verify_shapes"]["ms_per_step"] / curve[1]["ms_per_step"]
    if "prefill" in res:
        out["prefill_matmul_fraction"] = res["prefill"]["matmul_fraction"]
    if "exact" in res:
        out["bf16_exact"] = res["exact"]["exact_verify_shapes"]
        out["bf16_exact_one_column"] = res["exact"]["exact_one_column"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default="qwen3-8b", help="a builtin config name or a config.json path")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per row before the timed steps")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per measurement")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256", help="the device-loop curve's batch sizes")
    ap.add_argument("--scheduler-batches", default="32,128", help="batch sizes also run through the scheduler")
    ap.add_argument("--width", type=int, default=16, help="DFlash block width")
    ap.add_argument("--draft-vocabs", default="",
                    help="the dflash section also steps under reduced draft vocabularies of these sizes "
                         "(engine/token_map.py; seeded random hot ids: dummy weights draft nothing real), 0 = the "
                         "whole head, at each of --dflash-batches; reported apart from dflash_over_native_step")
    ap.add_argument("--draft-quantizations", default="",
                    help="the dflash section also steps with the drafter's few-row passes in these weight formats "
                         "(DFlashDrafter.quantize: fp8), under each of --draft-vocabs (or the whole head), at each of "
                         "--dflash-batches; reported apart from dflash_over_native_step")
    ap.add_argument("--dflash-batches", default="1", help="batch sizes of the --draft-vocabs steps")
    ap.add_argument("--long-contexts", default="4096",
                    help="prompt lengths of the `long` section's batch-1 native and DFlash steps ('' for none)")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--prefill-lengths", default="2048,8192",
                    help="prompt lengths whose prefill is also timed in the runner's default chunks and as one forward "
                         "(what a long prompt's TTFT costs; '' for none)")
    ap.add_argument("--exact-target", default=str(PAIR / "target"),
                    help="the exactness section's target (default: the installed package's demo pair)")
    ap.add_argument("--exact-draft", default=str(PAIR / "drafter"))
    ap.add_argument("--exact-prompts", type=int, default=8, help="per set of the speedup protocol (two sets)")
    ap.add_argument("--exact-new-tokens", type=int, default=256)
    ap.add_argument("--sections", default="paged,curve,scheduler,dflash,long,prefill,exact")
    ap.add_argument("--profile-batches", default="1,4,128",
                    help="curve batch sizes also profiled (GPU-busy time, kernels, the top kernels by time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall-dump-s", type=float, default=120.0,
                    help="print every thread's stack when a section runs this long, and again each as long")
    ap.add_argument("--eager-rounding", action="store_true",
                    help="compile every runner with RunnerConfig.compile_eager_rounding (off: the engine's default)")
    ap.add_argument("--inductor-option", action="append", default=[], metavar="NAME=VALUE",
                    help="an inductor config entry for every runner (RunnerConfig.inductor_extra); repeatable")
    ap.add_argument("--blas", choices=("cublas", "cublaslt"), default=RunnerConfig.blas,
                    help="the BLAS library of every runner (RunnerConfig.blas; process-wide in torch)")
    ap.add_argument("--fp8-widen", choices=("bits", "triton"), default="bits" if skinny_gemm.FP8_BITS else "triton",
                    help="how the few-row kernel's fp8 forms widen e4m3 to bf16 (skinny_gemm.FP8_BITS; an A/B for "
                         "--draft-quantizations fp8)")
    ap.add_argument("--rope-in-attention", choices=("on", "off"), default="on" if qkv_rope.IN_ATTENTION else "off",
                    help="the fused layer's q/k norms, RoPE and cache write inside the paged attention's launch "
                         "(qkv_rope.IN_ATTENTION; other bits than off's, the same in every path)")
    ap.add_argument("--out", default="bench/results/speed_8b.json")
    a = ap.parse_args()
    extra = tuple(inductor_option(o) for o in a.inductor_option)
    RunnerConfig(inductor_extra=extra)  # an unknown entry fails here, before minutes of setup
    if not torch.cuda.is_available():
        raise SystemExit("speed_8b needs a CUDA GPU")
    sections = set(a.sections.split(","))
    skinny_gemm.FP8_BITS = a.fp8_widen == "bits"
    qkv_rope.IN_ATTENTION = a.rope_in_attention == "on"
    res: dict = {"bench": "speed_8b", "config": a.config, "dtype": "bfloat16", "weights": "dummy",
                 "command": command_line("flashpd.bench.speed_8b")}

    def save() -> None:
        write_json(Path(a.out), {**res, **fields(res)})

    cfg = load_config(builtin_config_path(a.config) if not a.config.endswith(".json") else a.config)
    res["copy_bandwidth"] = copy_bandwidth_gbs()
    rate = res["copy_bandwidth"]["gb_per_s"] * 1e9
    res["matmul_tflops_bf16"] = matmul_tflops()
    log(f"copy {rate / 1e9:.0f} GB/s, matmul {res['matmul_tflops_bf16']:.0f} TFLOP/s")
    batches = [int(x) for x in a.batches.split(",")]
    profiled_batches = {int(x) for x in a.profile_batches.split(",") if x}
    sched_batches = [int(x) for x in a.scheduler_batches.split(",") if x] if "scheduler" in sections else []
    lengths = [int(x) for x in a.prefill_lengths.split(",") if x] if "prefill" in sections else []
    long_contexts = [int(x) for x in a.long_contexts.split(",") if x] if "long" in sections else []
    tokens = (max(batches + sched_batches) + 1) * (a.context + (a.steps + 40) * 1) + 4 * (a.prefill_tokens + 64) \
        + max(lengths, default=0) + 64 \
        + (a.context + (a.steps + 12) * a.width) * 2
    if long_contexts:  # one session at a time, the DFlash one the larger
        tokens += max(long_contexts) + (a.steps + 12) * a.width + 16
    if a.draft_vocabs:  # DFlash rows at the largest --dflash-batches, one session at a time
        tokens += max(int(x) for x in a.dflash_batches.split(",")) * (a.context + (a.steps + 12) * a.width + 16)
    target = dummy_target(cfg, "cuda", torch.bfloat16)
    drafter = dummy_drafter(drafter_config_for(cfg, 5), target)
    runner = ModelRunner(target, num_blocks=tokens // 16 + 64, kv_block_size=16,
                         taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(compile_eager_rounding=a.eager_rounding, inductor_extra=extra,
                                             blas=a.blas))
    res["compile_eager_rounding"] = a.eager_rounding
    res["blas"] = a.blas
    res["pdl"] = {"enabled": triton_env.pdl(torch.device("cuda")), "latency_release": triton_env.PDL_LATENCY_RELEASE,
                  "release_to_latency": triton_env.PDL_RELEASE_TO_LATENCY,
                  "release_max_rows": triton_env.PDL_RELEASE_MAX_ROWS}
    res["inductor_extra"] = dict(extra)
    res["fp8_widen"] = "bits" if skinny_gemm.FP8_BITS else "triton"
    res["rope_in_attention"] = qkv_rope.IN_ATTENTION
    native = NativeGenerator(runner, ())
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    embed = target.embed_tokens.weight
    read_bytes = weight_bytes - embed.numel() * embed.element_size() + embed.shape[1] * embed.element_size()
    kv_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    res.update(weight_bytes=weight_bytes, weight_bytes_read=read_bytes, kv_bytes_per_token=kv_token,
               floor_ms_b1_weights_only=weight_bytes / rate * 1e3)

    def floor(row: dict) -> dict:
        kv = kv_token * row["batch"] * row["context_mean"]
        row["floor_ms"] = (weight_bytes + kv) / rate * 1e3
        row["floor_ms_bytes_read"] = (read_bytes + kv) / rate * 1e3
        row["floor_fraction"] = row["floor_ms"] / row["ms_per_step"]
        row["tokens_per_s"] = row["batch"] / row["ms_per_step"] * 1e3 if "tokens_per_s" not in row else \
            row["tokens_per_s"]
        return row

    def curve() -> None:
        res["native_curve"] = []
        for b in batches:
            t0 = time.perf_counter()
            row = floor(loop_steps(native, random_prompts(b, a.context, cfg.vocab_size, a.seed + b), a.steps,
                                   profiled=b in profiled_batches))
            res["native_curve"].append(row)
            log(f"native b={b}: {row['ms_per_step']:.3f} ms/step, floor {row['floor_ms']:.3f} "
                f"(x{row['ms_per_step'] / row['floor_ms']:.3f}; {time.perf_counter() - t0:.0f} s)")
            if "top_kernels" in row:
                log(f"  b={b} profiled: {row['gpu_busy_ms_per_step']:.3f} ms GPU-busy, {row['kernels_per_step']:.0f} "
                    "kernels; top: " + "; ".join(f"{k['name'][:48]} {k['ms_per_step']:.3f}" for k in row["top_kernels"][:4]))
            save()

    def scheduler() -> None:
        res["scheduler"] = []
        for b in sched_batches:
            row = scheduler_steps(runner, b, a.context, a.steps, cfg.vocab_size)
            row["context_mean"] = a.context + a.steps / 2
            res["scheduler"].append(floor(row))
            log(f"scheduler b={b}: {row['ms_per_step']:.3f} ms/step, fraction {row['floor_fraction']:.3f}")
            save()

    def dflash() -> None:
        prompt = random_prompts(1, a.context, cfg.vocab_size, a.seed)
        wide = NativeGenerator(runner, (), step_width=a.width)
        res["native_b1_verify_shapes"] = loop_steps(wide, prompt, a.steps, profiled=True)
        log(f"native b=1 at the verify's shapes: {res['native_b1_verify_shapes']['ms_per_step']:.3f} ms/step")
        save()
        res["dflash_b1"] = loop_steps(DFlashGenerator(runner, drafter, ()), prompt, a.steps, width=a.width,
                                      profiled=True)
        log(f"dflash b=1 width {a.width}: {res['dflash_b1']['ms_per_step']:.3f} ms/step")
        sizes = [int(x) for x in a.draft_vocabs.split(",") if x]
        if sizes:
            res["dflash_draft_vocab"] = []

        def hot_ids(n: int) -> torch.Tensor | None:  # seeded random hot ids (0: the whole head)
            return None if n == 0 else torch.sort(torch.randperm(cfg.vocab_size, generator=torch.Generator()
                                                                 .manual_seed(a.seed))[:n]).values

        for n in sizes:
            drafter.set_token_map(hot_ids(n))
            for b in [int(x) for x in a.dflash_batches.split(",") if x]:
                row = loop_steps(DFlashGenerator(runner, drafter, ()), random_prompts(b, a.context, cfg.vocab_size,
                                                                                      a.seed + b),
                                 a.steps, width=a.width, profiled=b in profiled_batches)
                res["dflash_draft_vocab"].append({"draft_vocab": n, **row})
                log(f"dflash b={b} width {a.width} draft vocabulary {n or 'full'}: {row['ms_per_step']:.3f} ms/step")
                save()
        for q in [x for x in a.draft_quantizations.split(",") if x]:
            res.setdefault("dflash_draft_quant", [])
            for n in sizes or [0]:
                drafter.set_token_map(hot_ids(n))
                drafter.quantize(q)
                for b in [int(x) for x in a.dflash_batches.split(",") if x]:
                    row = loop_steps(DFlashGenerator(runner, drafter, ()),
                                     random_prompts(b, a.context, cfg.vocab_size, a.seed + b), a.steps, width=a.width,
                                     profiled=b in profiled_batches)
                    res["dflash_draft_quant"].append({"draft_quantization": q, "draft_vocab": n, **row})
                    log(f"dflash b={b} width {a.width} draft {q}, vocabulary {n or 'full'}: "
                        f"{row['ms_per_step']:.3f} ms/step")
                    save()
                drafter.quantize(None)
        drafter.set_token_map(None)
        for b in [int(x) for x in a.dflash_batches.split(",") if x and int(x) > 1] if sizes else []:
            row = loop_steps(wide, random_prompts(b, a.context, cfg.vocab_size, a.seed + b), a.steps,
                             profiled=b in profiled_batches)
            res.setdefault("native_verify_shapes", []).append(row)
            log(f"native b={b} at the verify's shapes: {row['ms_per_step']:.3f} ms/step")
            save()

    def long_rows() -> None:
        res["by_context"] = []
        for n in long_contexts:
            prompt = random_prompts(1, n, cfg.vocab_size, a.seed + n)
            row = {"context": n, "native": loop_steps(native, prompt, a.steps),
                   "dflash": loop_steps(DFlashGenerator(runner, drafter, ()), prompt, a.steps, width=a.width)}
            res["by_context"].append(row)
            nat, dfl = row["native"]["ms_per_step"], row["dflash"]["ms_per_step"]
            log(f"context {n}, batch 1: native {nat:.3f} ms/step, dflash width {a.width} {dfl:.3f} (x{dfl / nat:.3f})")
            save()

    def prefill() -> None:
        prompt = random_prompts(1, a.prefill_tokens, cfg.vocab_size, a.seed)[0]
        default = runner.config
        rows = {}
        for chunk in (runner.config.prefill_chunk, a.prefill_tokens):
            runner.reconfigure(prefill_chunk=chunk, prefill_graph_tokens=chunk or runner.config.prefill_graph_tokens)
            rows[str(chunk)] = measure_prefill(native, prompt, 5, cuda=True)
        best = min(rows, key=rows.get)
        flops = prefill_flops(cfg, a.prefill_tokens)
        ms = rows[best]
        res["prefill"] = {"tokens": a.prefill_tokens, "ms_by_graph_tokens": rows, "graph_tokens": int(best),
                          "ms": ms, "flops": flops, "tflops": flops / (ms * 1e-3) / 1e12,
                          "matmul_fraction": flops / (ms * 1e-3) / 1e12 / res["matmul_tflops_bf16"]}
        log(f"prefill {a.prefill_tokens}: {rows} ms; {res['prefill']['tflops']:.0f} TFLOP/s")
        runner.reconfigure(prefill_chunk=default.prefill_chunk, prefill_graph_tokens=default.prefill_graph_tokens)
        by_length = []
        for n in lengths:  # the serving default (chunks as graphs) against one forward (eager past the graph size)
            long_prompt = random_prompts(1, n, cfg.vocab_size, a.seed + n)[0]
            row = {"tokens": n, "chunk": runner.config.prefill_chunk,
                   "chunked_ms": measure_prefill(native, long_prompt, 3, cuda=True)}
            runner.reconfigure(prefill_chunk=None)
            row["one_forward_ms"] = measure_prefill(native, long_prompt, 3, cuda=True)
            runner.reconfigure(prefill_chunk=default.prefill_chunk)
            by_length.append(row)
            log(f"prefill {n}: {row['chunked_ms']:.1f} ms in chunks of {row['chunk']}, {row['one_forward_ms']:.1f} "
                f"as one forward")
        res["prefill"]["by_length"] = by_length

    def paged() -> None:
        res["paged_agreement"] = paged_agreement(target, random_prompts(8, a.context, cfg.vocab_size, a.seed))
        log(f"paged vs gather, one decode forward at batch 8: {res['paged_agreement']}")

    def exact() -> None:
        res["exact"] = exactness(a.exact_target, a.exact_draft, a.exact_prompts, a.exact_new_tokens, a.width,
                                 a.seed, eager_rounding=a.eager_rounding, inductor_extra=extra, blas=a.blas)

    for name, fn in (("paged", paged), ("curve", curve), ("scheduler", scheduler), ("dflash", dflash),
                     ("long", long_rows), ("prefill", prefill), ("exact", exact)):
        if name in sections:
            with watched(name, res, a.stall_dump_s):
                fn()
            save()
    res["copy_bandwidth_end"] = copy_rate_again(res["copy_bandwidth"]["gb_per_s"])
    save()
    log("done: " + ", ".join(f"{k} {v}" for k, v in fields(res).items()))


def copy_rate_again(start_gbs: float) -> dict:
    """The copy rate read again after the sections, beside the start's reading that the floors use: the reading
    moved 1-2.5% between processes on one machine (bench/results/2026-12-03_epilogue_fused_727a853), and every
    floor fraction moves with it. Out of memory is recorded, not raised: the sections' results are already saved."""
    try:
        end = copy_bandwidth_gbs()
    except torch.cuda.OutOfMemoryError as e:
        log(f"copy rate at the end: not read ({e})")
        return {"error": f"out of memory: {e}"}
    end["change_from_start"] = end["gb_per_s"] / start_gbs - 1
    log(f"copy rate at the end {end['gb_per_s']:.0f} GB/s ({end['change_from_start']:+.1%} against the start's, "
        "which the floors use)")
    return end


if __name__ == "__main__":
    main()

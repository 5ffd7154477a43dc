"""The drafter's few-row passes in fp8 (DFlashDrafter.quantize): which weights each pass reads, and that drafting
from them never changes the output.

float32 CPU, the tiny fixture pair. Under quantize("fp8") a pass of at most 16 rows (a batch-1 draft, its context
write) reads the fp8 weights (their values widened back where the few-row kernel does not run), a wider pass the
checkpoint's; a context write of any size takes fc's fp8 values (a prefix hit's tail must be written as a cold
prefill's). The output must stay native greedy decoding's, with guesses still accepted; a drafter whose fp8 head
is zeroed must get nothing accepted, which shows the fp8 copies are what the draft pass reads; quantize(None) gives
back the plain drafter's tokens and acceptance lengths.
"""
from __future__ import annotations

import pytest
import torch

from _dflash_helpers import dflash_engine, dflash_pair, greedy, run_checked  # noqa: F401 (fixtures by name)
from conftest import assert_fp32_close, fp32_atol
from flashpd.engine.drafter import load_drafter
from flashpd.engine.skinny_gemm import MAX_ROWS, Fp8Weight
from flashpd.engine.spec_decode import DFlashGenerator

PROMPTS = slice(0, 4)
MAX_TOKENS = 40


def _drafter(engine, pair, quantization):
    d = load_drafter(pair.draft_dir, engine.target)
    d.quantize(quantization)
    return d


def _run(engine, drafter, prompts, width=16):
    """Each prompt alone: a batch-1 draft pass is the one of at most 16 rows (a batch of several reads bf16)."""
    gen = DFlashGenerator(engine.runner, drafter, draft_width=width)
    return [run_checked(gen, [p], [greedy(MAX_TOKENS)])[0] for p in prompts]


def test_passes_read_fp8_up_to_the_few_row_kernels_rows(dflash_engine, dflash_pair):
    d = _drafter(dflash_engine, dflash_pair, "fp8")
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        few, wide = d.proj(0, name, MAX_ROWS), d.proj(0, name, MAX_ROWS + 1)
        assert isinstance(few, Fp8Weight) and few.data.dtype == torch.float8_e4m3fn
        assert wide is getattr(d.layers[0], name)
        torch.testing.assert_close(few.dequantize(torch.float32), wide, rtol=1 / 16, atol=1e-3)
    assert isinstance(d.fc_weight(3), Fp8Weight)  # past the few rows: the same fp8 values, widened back
    assert torch.equal(d.fc_weight(MAX_ROWS + 1), d.fc_weight(3).dequantize(d.fc.dtype))
    head = d.draft_head(15)
    assert isinstance(head, Fp8Weight) and d.draft_head(15) is head  # made once, by quantize
    assert d.draft_head(MAX_ROWS + 1) is d.head_weight
    d.set_token_map(torch.tensor([3, 7, 9]))  # a map made after quantize gets its own fp8 rows
    assert d.draft_head(15).shape == (3, head.shape[1])
    torch.testing.assert_close(d.draft_head(15).dequantize(torch.float32), d.head_weight, rtol=1 / 16, atol=1e-3)
    d.set_token_map(None)
    assert d.draft_head(15).shape == head.shape
    few = d.layer_weights(0, 16)  # the gathered pass (no kernel here): the fp8 values widened back
    assert torch.equal(few[1], d.proj(0, "qkv_proj", 16).dequantize(few[1].dtype))
    assert d.layer_weights(0, 17)[1] is d.layers[0].qkv_proj
    d.quantize(None)
    assert d.proj(0, "o_proj", 1) is d.layers[0].o_proj and d.fc_weight(1) is d.fc
    assert d.draft_head(1) is d.head_weight
    with pytest.raises(ValueError, match="quantization"):
        d.quantize("int4")


@pytest.mark.parametrize("width", [4, 16])
def test_fp8_drafts_keep_the_output_exact(dflash_engine, dflash_pair, width):
    prompts = dflash_pair.prompts[PROMPTS]
    native = dflash_engine.native(prompts, MAX_TOKENS)
    seqs = _run(dflash_engine, _drafter(dflash_engine, dflash_pair, "fp8"), prompts, width)
    assert [s.output for s in seqs] == native
    al = [a for s in seqs for a in s.stats.acceptance_lengths]
    assert sum(al) / len(al) > 1.2, "nothing accepted: exactness would hold trivially"


def test_the_draft_pass_reads_the_fp8_copies(dflash_engine, dflash_pair):
    """Zero the fp8 head's values: the draft's logits are all zero, its guesses the first id, and nothing the
    target emits past it is accepted; the output is still native's."""
    prompts = dflash_pair.prompts[PROMPTS]
    native = dflash_engine.native(prompts, MAX_TOKENS)
    d = _drafter(dflash_engine, dflash_pair, "fp8")
    d.draft_head(15).data.zero_()
    seqs = _run(dflash_engine, d, prompts)
    assert [s.output for s in seqs] == native
    al = [a for s in seqs for a in s.stats.acceptance_lengths]
    assert sum(al) / len(al) < 1.2, "the draft pass did not read the fp8 head"


def test_unquantized_again_drafts_as_the_plain_drafter(dflash_engine, dflash_pair):
    prompts = dflash_pair.prompts[PROMPTS]
    back = _drafter(dflash_engine, dflash_pair, "fp8")
    back.quantize(None)
    a = _run(dflash_engine, back, prompts)
    b = _run(dflash_engine, _drafter(dflash_engine, dflash_pair, None), prompts)
    assert [s.output for s in a] == [s.output for s in b]
    assert [s.stats.acceptance_lengths for s in a] == [s.stats.acceptance_lengths for s in b]


# ---- the public face ---------------------------------------------------------------------------------

def test_speculative_config_and_serve_config_take_fp8():
    from flashpd.cli import parse_speculative_config
    from flashpd.cluster.config import ServeConfig

    spec = parse_speculative_config('{"method": "dflash", "model": "d", "quantization": "fp8"}')
    assert spec["quantization"] == "fp8"
    with pytest.raises(ValueError, match="quantization"):
        parse_speculative_config('{"method": "dflash", "model": "d", "quantization": "int4"}')
    with pytest.raises(ValueError, match="draft_quantization"):
        ServeConfig(target="t", draft_quantization="fp8")  # no drafter
    with pytest.raises(ValueError, match="draft_quantization"):
        ServeConfig(target="t", draft="d", draft_quantization="int4")
    assert ServeConfig(target="t", draft="d", draft_quantization="fp8").public_settings()["draft_quantization"] == "fp8"


def test_load_engine_and_the_cli_draft_in_fp8(dflash_engine, dflash_pair, tmp_path, capsys):
    import json

    from flashpd.cli import main as cli_main
    from flashpd.engine.factory import load_engine

    e = load_engine(dflash_pair.target_dir, dflash_pair.draft_dir, "cpu", "float32", 2048,
                    draft_quantization="fp8")
    assert e.drafter.quantization == "fp8"
    with pytest.raises(ValueError, match="draft quantization"):
        load_engine(dflash_pair.target_dir, None, "cpu", "float32", 2048, draft_quantization="fp8")
    prompt = dflash_pair.prompts[1]
    native = dflash_engine.native([prompt], MAX_TOKENS)[0]
    spec = json.dumps({"method": "dflash", "model": str(dflash_pair.draft_dir), "quantization": "fp8"})
    assert cli_main(["generate", "--target", str(dflash_pair.target_dir), "--speculative-config", spec,
                     "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
                     "--device", "cpu", "--dtype", "float32", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["token_ids"] == native and max(got["stats"]["acceptance_lengths"]) > 1


def test_the_service_drafts_in_fp8_when_configured(tmp_path):
    """`flashpd serve` with draft_quantization "fp8" (a real colocated server over gRPC, the demo pair): Health
    reports it, and DFlash's output equals native decoding with guesses accepted."""
    import json
    from pathlib import Path

    from flashpd.cluster.generation_client import GenerationClient
    from tests._serve_process import serve_process

    demo = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"
    prompt, n = "def add(a, b):\n", 24
    cfg = tmp_path / "serve.json"
    cfg.write_text(json.dumps({"target": str(demo / "target"), "draft": str(demo / "drafter"),
                               "draft_quantization": "fp8", "device": "cpu", "dtype": "float32",
                               "kv_cache_tokens": 2048, "torch_threads": 1}))
    with serve_process([str(cfg)], start_timeout_s=90) as (address, _):
        with GenerationClient(address, timeout_s=60) as c:
            assert c.health()["settings"]["draft_quantization"] == "fp8"
            spec = c.generate_once(prompt, max_tokens=n, method="dflash", ignore_eos=True)
            plain = c.generate_once(prompt, max_tokens=n, method="native", ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    assert max(spec.stats["acceptance_lengths"]) > 1


def test_a_context_write_takes_the_same_weights_at_every_size(dflash_engine, dflash_pair):
    """A prefix hit writes its tail's context K/V in a write of a few rows, a cold prefill the whole prompt's in
    one of many: under fp8 both must take the same fc values, or a hit drafts otherwise than a cold run (the
    review's repro: acceptance differed on 7 of 300 prompts). The values each size takes are the same, bitwise; a
    write of 40 positions equals one of 32 + 8 up to float32 rounding (a CPU BLAS may round a row otherwise by the
    rows beside it: MKL on an AVX-512 machine does at 40 rows against 8), where the checkpoint's weights against
    their fp8 values differ by far more (checked below)."""
    d = _drafter(dflash_engine, dflash_pair, "fp8")
    c = d.cfg
    few, many = d.fc_weight(8), d.fc_weight(40)
    assert isinstance(few, Fp8Weight) and torch.equal(few.dequantize(many.dtype), many)
    n, bs = 40, 16
    g = torch.Generator().manual_seed(3)
    taps = torch.randn(n, len(c.target_layer_ids) * c.hidden_size, generator=g)
    pos = torch.arange(n)
    cache = torch.zeros(c.num_hidden_layers, 2, 4, bs, c.num_key_value_heads, c.head_dim)
    whole, split, plain = cache.clone(), cache.clone(), cache.clone()
    d.write_context(whole, taps, pos, pos)
    d.write_context(split, taps[:32], pos[:32], pos[:32])
    d.write_context(split, taps[32:], pos[32:], pos[32:])
    assert whole.abs().sum() > 0
    assert_fp32_close(split, whole, ulps=64)
    d.quantization, q = None, d.quantization  # the checkpoint's fc: what a many-row write read before the fix
    try:
        d.write_context(plain, taps, pos, pos)
    finally:
        d.quantization = q
    assert (plain - whole).abs().max() > 1000 * fp32_atol(whole.float(), 64)


def test_the_fingerprint_tells_the_draft_formats_apart(dflash_engine, dflash_pair):
    """fp8 and bf16 drafters write different context K/V, so their entries get different keys. Neither format's
    keys are the ones before KV_VERSION 2: fp8 entries written then were keyed as bf16 ones, and must never hit."""
    import hashlib
    import json
    from types import SimpleNamespace

    from flashpd.cluster.worker_main import fingerprint
    from flashpd.kv_bridge.keys import KV_VERSION, LAYOUT_VERSION, MethodFingerprint

    before = hashlib.sha256(json.dumps({"target": "t", "drafter": "d", "target_layer_ids": [1, 3], "dtype": "bfloat16",
                                        "layout_version": LAYOUT_VERSION}, sort_keys=True).encode()).hexdigest()
    bf16 = MethodFingerprint("t", "d", (1, 3), "bfloat16").digest()
    fp8_fp = MethodFingerprint("t", "d", (1, 3), "bfloat16", draft_quantization="fp8").digest()
    assert len({before, bf16, fp8_fp}) == 3
    assert MethodFingerprint("t", "d", (1, 3), "bfloat16", kv_version=KV_VERSION + 1).digest() != bf16
    llm = SimpleNamespace(drafter=_drafter(dflash_engine, dflash_pair, "fp8"), dtype=torch.float32,
                          target_stamps=(), draft_stamps=())
    cfg = SimpleNamespace(target=dflash_pair.target_dir, draft=dflash_pair.draft_dir, draft_quantization="fp8")
    fp8 = fingerprint(cfg, llm)
    assert fp8 != fingerprint(SimpleNamespace(**{**vars(cfg), "draft_quantization": None}), llm)

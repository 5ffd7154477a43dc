"""DFlash at the edges: drafter/target mismatch refused at load, the Python API and the CLI.

Mismatched drafters are made by editing config.json in a copy of the fixture drafter directory;
each must be refused with DrafterMismatch (a CheckpointError) whose message names the field.
"""
from __future__ import annotations

import logging

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _dflash_helpers import (  # noqa: F401  (fixtures are used by name)
    dflash_engine, dflash_pair, reference_generate)
from flashpd.engine.sampling import SamplingParams
from flashpd.llm import LLM  # (not `from flashpd import LLM`: see the report on the editable install)
from flashpd.cli import main as cli_main
from flashpd.engine.config import CheckpointError
from flashpd.engine.drafter import DFlashConfig, DrafterMismatch, default_target_layer_ids, load_drafter
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.spec_decode import DFlashGenerator


# ---- 6. mismatch refusal ---------------------------------------------------------------------------

def _edited_drafter(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _set(key, value, section=None):
    def edit(cfg):
        (cfg.setdefault(section, {}) if section else cfg)[key] = value
    return edit


MISMATCHES = {  # name: (edit, words the message must contain)
    "hidden_size": (_set("hidden_size", 96), ["hidden_size", "96", "64"]),
    "num_target_layers": (_set("num_target_layers", 6), ["num_target_layers", "6", "5"]),
    "num_target_layers-in-dflash_config": (_set("num_target_layers", 4, "dflash_config"), ["num_target_layers", "4"]),
    "vocab_size": (_set("vocab_size", 200), ["vocab_size", "200", "128"]),
    "target_layer_ids-too-high": (_set("target_layer_ids", [0, 2, 5], "dflash_config"), ["target_layer_ids", "5"]),
    "target_layer_ids-negative": (_set("target_layer_ids", [-1, 2, 3], "dflash_config"), ["target_layer_ids"]),
    "target_layer_ids-repeated": (_set("target_layer_ids", [0, 2, 2], "dflash_config"), ["target_layer_ids"]),
    "mask_token_id-too-high": (_set("mask_token_id", 128, "dflash_config"), ["mask_token_id", "128"]),
    "mask_token_id-negative": (_set("mask_token_id", -1, "dflash_config"), ["mask_token_id", "-1"]),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatched_drafter_is_refused_naming_the_field(dflash_pair, dflash_engine, tmp_path, name):
    edit, words = MISMATCHES[name]
    d = _edited_drafter(dflash_pair.draft_dir, tmp_path / "drafter", edit)
    with pytest.raises(DrafterMismatch) as e:
        load_drafter(d, dflash_engine.target)
    assert isinstance(e.value, CheckpointError)
    for w in words:
        assert w in str(e.value), f"message {str(e.value)!r} does not name {w!r}"


@pytest.mark.parametrize("key,value", [("hidden_act", "gelu"), ("mlp_bias", True), ("partial_rotary_factor", 0.5)])
def test_a_drafter_whose_layers_compute_otherwise_is_refused(dflash_pair, dflash_engine, tmp_path, key, value):
    """The drafter's layers are Qwen3's: a config that says otherwise is refused by name, not drafted with silently."""
    d = _edited_drafter(dflash_pair.draft_dir, tmp_path / "drafter", _set(key, value))
    with pytest.raises(CheckpointError, match=key):
        load_drafter(d, dflash_engine.target)


def test_unedited_copy_loads(dflash_pair, dflash_engine, tmp_path):
    """Control for the mismatch tests: the copy mechanism itself yields a loadable drafter."""
    d = _edited_drafter(dflash_pair.draft_dir, tmp_path / "drafter", lambda cfg: None)
    m = load_drafter(d, dflash_engine.target)
    assert m.cfg == dflash_engine.drafter.cfg


def test_target_directory_as_drafter_is_a_clear_error(dflash_pair, dflash_engine):
    with pytest.raises(CheckpointError, match="not a DFlash drafter") as e:
        load_drafter(dflash_pair.target_dir, dflash_engine.target)
    assert "Qwen3ForCausalLM" in str(e.value)


def test_directory_without_config_is_a_clear_error(dflash_engine, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_drafter(tmp_path, dflash_engine.target)


def test_drafter_weights_of_wrong_shape_are_refused(dflash_pair, dflash_engine, tmp_path):
    """A field check_fits does not cover (the drafter's own MLP width) fails on the tensor shape."""
    d = _edited_drafter(dflash_pair.draft_dir, tmp_path / "drafter", _set("intermediate_size", 96))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_drafter(d, dflash_engine.target)


def test_missing_mask_token_is_refused(dflash_pair, dflash_engine, tmp_path):
    d = _edited_drafter(dflash_pair.draft_dir, tmp_path / "drafter", lambda cfg: cfg["dflash_config"].pop("mask_token_id"))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_drafter(d, dflash_engine.target)


def test_runner_taps_must_match_drafter(dflash_engine):
    runner = ModelRunner(dflash_engine.target, num_blocks=8, kv_block_size=16, taps=(0, 1, 2),
                         config=RunnerConfig(cuda_graphs=False))
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashGenerator(runner, dflash_engine.drafter)


@pytest.mark.parametrize("n_target,n_draft", [(5, 1), (36, 5), (28, 3), (64, 8), (12, 2)])
def test_default_target_layer_ids_match_reference(n_target, n_draft):
    from dflash.model import build_target_layer_ids

    assert default_target_layer_ids(n_target, n_draft) == build_target_layer_ids(n_target, n_draft)
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": n_draft, "num_attention_heads": 4,
           "num_target_layers": n_target, "dflash_config": {"mask_token_id": 0}}
    assert list(DFlashConfig.from_dict(cfg).target_layer_ids) == build_target_layer_ids(n_target, n_draft)


# ---- 7. Python API ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(dflash_pair):
    return LLM(target=dflash_pair.target_dir, draft=dflash_pair.draft_dir, device="cpu", dtype="float32",
               kv_cache_tokens=8192)


def test_llm_generate_reports_acceptance_and_tau(dflash_pair, dflash_engine, llm):
    pair = dflash_pair
    assert llm.method == "dflash" and llm.block_size == 16
    prompts = pair.prompts[:4]
    outs = llm.generate(prompts, SamplingParams(max_tokens=45, ignore_eos=True))
    assert len(outs) == 4
    native = dflash_engine.native(prompts, 45)
    for p, o, want in zip(prompts, outs, native):
        ids, al = reference_generate(pair, p, 45)
        assert o.token_ids == want == ids and o.prompt_token_ids == p
        assert o.finish_reason == "length"
        assert o.stats.acceptance_lengths == al
        assert o.stats.tau == pytest.approx(sum(al) / len(al))
        d = o.as_dict()
        assert d["stats"]["acceptance_lengths"] == al and d["stats"]["tau"] == pytest.approx(o.stats.tau)
    assert max(o.stats.tau for o in outs) > 1.2


def test_llm_single_prompt_and_block_size(dflash_pair):
    pair = dflash_pair
    llm4 = LLM(target=pair.target_dir, draft=pair.draft_dir, block_size=4, device="cpu", dtype="float32",
               kv_cache_tokens=2048)
    out = llm4.generate(pair.prompts[2], SamplingParams(max_tokens=30, ignore_eos=True))
    assert len(out) == 1
    assert (out[0].token_ids, out[0].stats.acceptance_lengths) == reference_generate(pair, pair.prompts[2], 30, 4)


def test_llm_warmup_leaves_the_engine_as_it_was(dflash_pair, llm, caplog):
    """LLM(warmup=True) runs throwaway requests first (on a GPU by default, where the first request otherwise
    held a minute of compiles in its TTFT): every KV block comes back, the output is the unwarmed one's, and the
    start and end are logged. On the CPU the default is no warm-up."""
    pair = dflash_pair
    assert llm.warmup_s is None  # CPU: off by default
    with caplog.at_level(logging.INFO, logger="flashpd.llm"):
        warm = LLM(target=pair.target_dir, draft=pair.draft_dir, block_size=4, device="cpu", dtype="float32",
                   kv_cache_tokens=2048, warmup=True)
    assert warm.warmup_s is not None and warm.warmup_s > 0
    assert "warming up on cpu" in caplog.text and "warm in" in caplog.text
    assert warm.runner.allocator.num_free == warm.runner.allocator.num_blocks - 1  # (block 0: scratch)
    out = warm.generate(pair.prompts[2], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert (out.token_ids, out.stats.acceptance_lengths) == reference_generate(pair, pair.prompts[2], 30, 4)
    # a KV cache too small for the warm-up's longer prompts: those are skipped, not a failed construction
    small = LLM(target=pair.target_dir, draft=pair.draft_dir, block_size=4, device="cpu", dtype="float32",
                kv_cache_tokens=96, warmup=True)
    assert small.runner.allocator.num_free == small.runner.allocator.num_blocks - 1


def test_llm_native_has_no_acceptance(dflash_pair, dflash_engine):
    llm = LLM(target=dflash_pair.target_dir, device="cpu", dtype="float32", kv_cache_tokens=2048)
    assert llm.method == "native"
    o = llm.generate([dflash_pair.prompts[1]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert o.token_ids == dflash_engine.native([dflash_pair.prompts[1]], 20)[0]
    assert o.stats.acceptance_lengths == [] and o.stats.tau is None


def test_llm_refuses_mismatched_drafter(dflash_pair, tmp_path):
    d = _edited_drafter(dflash_pair.draft_dir, tmp_path / "drafter", _set("hidden_size", 96))
    with pytest.raises(DrafterMismatch, match="hidden_size"):
        LLM(target=dflash_pair.target_dir, draft=d, device="cpu", dtype="float32", kv_cache_tokens=1024)


# ---- 7. CLI ------------------------------------------------------------------------------------------

def _cli(capsys, *args) -> tuple[int, str, str]:
    try:
        rc = cli_main(["generate", *map(str, args)])
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _cli_json(capsys, *args) -> dict:
    rc, out, err = _cli(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _ids(prompt: list[int]) -> str:
    return ",".join(map(str, prompt))


def test_cli_generate_json_with_drafter(dflash_pair, dflash_engine, capsys):
    pair = dflash_pair
    p = pair.prompts[3]
    got = _cli_json(capsys, "--target", pair.target_dir, "--draft", pair.draft_dir, "--prompt-ids", _ids(p),
                    "--max-tokens", 40, "--ignore-eos", "--device", "cpu", "--dtype", "float32")
    assert got["token_ids"] == dflash_engine.native([p], 40)[0]
    assert got["finish_reason"] == "length"
    st = got["stats"]
    assert st["acceptance_lengths"] == reference_generate(pair, p, 40)[1]
    assert sum(st["acceptance_lengths"]) == 39
    assert st["tau"] == pytest.approx(39 / len(st["acceptance_lengths"]))
    native = _cli_json(capsys, "--target", pair.target_dir, "--prompt-ids", _ids(p), "--max-tokens", 40,
                       "--ignore-eos", "--device", "cpu")
    assert native["token_ids"] == got["token_ids"]
    assert native["stats"]["acceptance_lengths"] == [] and native["stats"]["tau"] is None


def test_cli_speculative_config_equals_draft_and_block_size(dflash_pair, capsys):
    pair = dflash_pair
    p = pair.prompts[5]
    common = ["--target", pair.target_dir, "--prompt-ids", _ids(p), "--max-tokens", 37, "--ignore-eos",
              "--device", "cpu"]
    spec = json.dumps({"method": "dflash", "model": str(pair.draft_dir), "num_speculative_tokens": 3})
    a = _cli_json(capsys, *common, "--speculative-config", spec)
    b = _cli_json(capsys, *common, "--draft", pair.draft_dir, "--block-size", 4)
    assert a["token_ids"] == b["token_ids"]
    assert a["stats"]["acceptance_lengths"] == b["stats"]["acceptance_lengths"]
    assert (a["token_ids"], a["stats"]["acceptance_lengths"]) == reference_generate(pair, p, 37, 4)
    assert max(a["stats"]["acceptance_lengths"]) <= 4
    # --method native ignores the speculative config whole, as it ignores --draft: its width too (it was kept, and
    # the run refused with "block_size 4 needs method 'dflash' and a drafter", a drafter having been given)
    n = _cli_json(capsys, *common, "--method", "native", "--speculative-config", spec)
    assert n["token_ids"] == a["token_ids"] and n["stats"]["tau"] is None


def _spec(pair, **kw) -> str:
    return json.dumps({"method": "dflash", "model": str(pair.draft_dir), **kw})


BAD = {  # name: (extra args given the pair, words the error must contain)
    "block-size-40": (lambda pr: ["--draft", pr.draft_dir, "--block-size", 40], ["block_size", "40"]),
    "block-size-1": (lambda pr: ["--draft", pr.draft_dir, "--block-size", 1], ["block_size", "1"]),
    "spec-unknown-key": (lambda pr: ["--speculative-config", _spec(pr, draft_tensor_parallel_size=1)],
                         ["unsupported keys", "draft_tensor_parallel_size"]),
    "spec-bad-json": (lambda pr: ["--speculative-config", '{"method": "dflash", '], ["not valid JSON"]),
    "spec-not-object": (lambda pr: ["--speculative-config", "[1, 2]"], ["JSON object"]),
    "spec-wrong-method": (lambda pr: ["--speculative-config", _spec(pr, method="eagle")], ["method", "eagle"]),
    "spec-no-model": (lambda pr: ["--speculative-config", '{"method": "dflash"}'], ["model"]),
    "spec-zero-tokens": (lambda pr: ["--speculative-config", _spec(pr, num_speculative_tokens=0)],
                         ["num_speculative_tokens"]),
    "spec-16-tokens": (lambda pr: ["--speculative-config", _spec(pr, num_speculative_tokens=16)],
                       ["block_size", "17"]),
    "spec-other-drafter": (lambda pr: ["--draft", pr.target_dir, "--speculative-config", _spec(pr)],
                           ["different drafters"]),
    "spec-other-width": (lambda pr: ["--block-size", 9, "--speculative-config", _spec(pr, num_speculative_tokens=3)],
                         ["--block-size 9", "num_speculative_tokens 3", "disagree"]),  # was overridden silently
    "dflash-without-drafter": (lambda pr: ["--method", "dflash"], ["needs a drafter"]),
    "target-as-drafter": (lambda pr: ["--draft", pr.target_dir], ["not a DFlash drafter"]),
    "missing-target": (lambda pr: ["--target", pr.target_dir / "nope"], ["not a directory"]),
    "max-tokens-0": (lambda pr: ["--draft", pr.draft_dir, "--max-tokens", 0], ["max_tokens"]),
    "prompt-id-out-of-vocab": (lambda pr: ["--draft", pr.draft_dir, "--prompt-ids", "1,2,999"], ["out of range", "999"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_cli_bad_values_exit_2_naming_the_problem(dflash_pair, capsys, name):
    extra, words = BAD[name]
    pair = dflash_pair
    args = ["--target", pair.target_dir, "--prompt-ids", "1,2,3", "--max-tokens", 8, "--device", "cpu", *extra(pair)]
    rc, out, err = _cli(capsys, *args)
    assert rc == 2, (rc, out, err)
    assert err.startswith("flashpd: error:"), err
    for w in words:
        assert w in err, f"error {err!r} does not mention {w!r}"


def test_cli_unparsable_prompt_ids_exit_2(dflash_pair, capsys):
    rc, _, err = _cli(capsys, "--target", dflash_pair.target_dir, "--prompt-ids", "1,x,3")
    assert rc == 2 and "--prompt-ids" in err


def test_cli_console_script_subprocess(dflash_pair, dflash_engine):
    """The installed `flashpd` entry point, as a user runs it."""
    pair = dflash_pair
    exe = Path(sys.executable).parent / "flashpd"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "flashpd.cli"]
    p = pair.prompts[0]
    r = subprocess.run([*cmd, "generate", "--target", str(pair.target_dir), "--draft", str(pair.draft_dir),
                        "--prompt-ids", _ids(p), "--max-tokens", "30", "--json", "--ignore-eos", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["token_ids"] == dflash_engine.native([p], 30)[0]
    assert got["stats"]["acceptance_lengths"] == reference_generate(pair, p, 30)[1]
    bad = subprocess.run([*cmd, "generate", "--target", str(pair.target_dir), "--prompt-ids", "1",
                          "--speculative-config", "{oops"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not valid JSON" in bad.stderr


def test_cli_block_size_zero_is_refused(dflash_pair, capsys):
    pair = dflash_pair
    rc, out, err = _cli(capsys, "--target", pair.target_dir, "--draft", pair.draft_dir, "--prompt-ids", "1,2,3",
                        "--max-tokens", 8, "--device", "cpu", "--block-size", 0)
    assert rc == 2 and "block_size" in err

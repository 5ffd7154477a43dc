"""Drafter training, the demo-pair recipe pieces, exports, and the shipped demo pair (float32, CPU)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_fp32_close
from flashpd.engine.drafter import load_drafter
from flashpd.engine.export import save_drafter, save_target
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.training.train_drafter import (DrafterTrainConfig, block_logits, evaluate_tau, regenerate,
                                            train_drafter)
from flashpd.engine.scheduler import generate

DEMO = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"


@pytest.fixture(scope="module")
def tiny_target(make_checkpoint):
    _, d = make_checkpoint(layers=4, kv_heads=2, head_dim=16, seed=21)
    return d, load_target(d)


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    d, target = tiny_target
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (24,), generator=g)]
    data = regenerate(target, prompts, 32, log=lambda m: None)
    out = tmp_path_factory.mktemp("drafter")
    logs: list[str] = []
    tc = DrafterTrainConfig(layers=1, block_size=8, num_taps=2, steps=40, seqs_per_step=4, anchors=16, lr=3e-3,
                            save_every=20)
    drafter = train_drafter(target, data, [len(p) for p in prompts], out, tc, log=logs.append)
    return target, drafter, out, prompts, data, logs


def _losses(logs: list[str]) -> list[float]:
    return [float(m.split(" loss ")[1].split()[0]) for m in logs if " loss " in m]


def test_drafter_training_loss_falls_and_checkpoint_loads(trained):
    target, drafter, out, prompts, _, logs = trained
    losses = _losses(logs)
    assert len(losses) >= 2 and losses[-1] < 0.7 * losses[0], losses
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert cfg["dflash_config"]["target_layer_ids"] == list(drafter.cfg.target_layer_ids)
    loaded = load_drafter(out, target)
    for (name, a), (_, b) in zip(drafter.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
    rows = evaluate_tau(target, loaded, prompts[:4], max_tokens=24)
    assert len(rows) == 4 and all(r["exact"] and r["tau"] >= 1 for r in rows)


def test_training_forward_is_the_inference_draft_pass(trained):
    """The masked many-block training pass computes exactly what a draft pass computes at that length."""
    target, drafter, _, _, data, _ = trained
    seq = data[0]
    a = len(seq) - 10
    with torch.no_grad():
        train_logits = block_logits(drafter, target, torch.tensor([seq]), torch.tensor([[a - 3, a]]))[0, 1]
    runner = ModelRunner(target, 64, 16, taps=tuple(drafter.cfg.target_layer_ids))
    gen = DFlashGenerator(runner, drafter, (), 8)
    s = gen.new_sequences([seq[:a]], [SamplingParams(max_tokens=4, ignore_eos=True)])[0]
    runner.allocator.ensure(s.table, a + 8)
    feats = gen.prefill([s], taps=True)
    gen.drafts.write_prompt([s], feats)
    s.output = [seq[a]]  # the committed last token of a draft at length a
    infer_logits = gen.drafts.draft([s], [8])[0]
    assert_fp32_close(train_logits, infer_logits)


def test_training_logits_take_the_drafters_output_scale_and_soft_cap(trained):
    """A drafter config with an output multiplier and a soft cap (z-lab's fields): the draft pass applies them, so
    training must too (it returned the head's raw logits: a fine-tuned drafter learnt other logits than it drafts)."""
    import dataclasses

    target, drafter, _, _, data, _ = trained
    seq, a = data[0], len(data[0]) - 10
    old = drafter.cfg
    drafter.cfg = dataclasses.replace(old, output_multiplier=0.5, final_logit_softcapping=3.0)
    try:
        with torch.no_grad():
            train_logits = block_logits(drafter, target, torch.tensor([seq]), torch.tensor([[a]]))[0, 0]
        runner = ModelRunner(target, 64, 16, taps=tuple(drafter.cfg.target_layer_ids))
        gen = DFlashGenerator(runner, drafter, (), 8)
        s = gen.new_sequences([seq[:a]], [SamplingParams(max_tokens=4, ignore_eos=True)])[0]
        runner.allocator.ensure(s.table, a + 8)
        gen.drafts.write_prompt([s], gen.prefill([s], taps=True))
        s.output = [seq[a]]
        infer_logits = gen.drafts.draft([s], [8])[0]
    finally:
        drafter.cfg = old
    assert infer_logits.abs().max() <= 3.0  # the cap is in force at inference
    assert_fp32_close(train_logits, infer_logits)


def test_resume_continues_from_the_saved_step(trained, tmp_path):
    target, _, out, prompts, data, _ = trained
    state = torch.load(out / "trainer_state.pt")
    assert state["step"] == 40
    logs: list[str] = []
    tc = DrafterTrainConfig(layers=1, block_size=8, num_taps=2, steps=45, seqs_per_step=4, anchors=16, lr=3e-3)
    train_drafter(target, data, [len(p) for p in prompts], out, tc, resume=True, log=logs.append)
    assert logs[0] == "resuming from step 40" and torch.load(out / "trainer_state.pt")["step"] == 45


def test_a_resumed_run_equals_the_uninterrupted_one(trained, tmp_path, monkeypatch):
    """Resuming reseeded the data and anchor draws from the step, so a run stopped after a checkpoint and resumed
    trained on other draws than the same run left alone; they are now restored from the checkpoint."""
    import flashpd.training.train_drafter as td

    target, _, _, prompts, data, _ = trained
    lens = [len(p) for p in prompts]
    tc = DrafterTrainConfig(layers=1, block_size=8, num_taps=2, steps=4, seqs_per_step=3, anchors=8, lr=3e-3,
                            save_every=2)
    whole = train_drafter(target, data, lens, tmp_path / "whole", tc, log=lambda m: None)
    save = td.save_checkpoint

    class Stop(Exception):
        pass

    def save_then_stop(*a, **kw):
        save(*a, **kw)
        raise Stop

    monkeypatch.setattr(td, "save_checkpoint", save_then_stop)
    with pytest.raises(Stop):
        train_drafter(target, data, lens, tmp_path / "cut", tc, log=lambda m: None)
    monkeypatch.setattr(td, "save_checkpoint", save)
    assert torch.load(tmp_path / "cut" / "trainer_state.pt")["step"] == 2
    state_file = tmp_path / "cut" / "trainer_state.pt"
    resumed = train_drafter(target, data, lens, tmp_path / "cut", tc, resume=True, log=lambda m: None)
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name
    saved = torch.load(state_file)  # the last save's (its weights' save id)
    # a checkpoint from a GPU run resumed on the CPU: a CUDA generator's state does not fit a CPU one (set_state
    # raised); the anchors are drawn afresh, said in the log
    saved["step"], saved["rng"]["device"], saved["rng"]["anchors"] = 2, "cuda", torch.zeros(16, dtype=torch.uint8)
    torch.save(saved, state_file)
    logs: list[str] = []
    train_drafter(target, data, lens, tmp_path / "cut", tc, resume=True, log=logs.append)
    assert any("anchors drawn afresh" in m for m in logs), logs


def test_exports_load_in_transformers_and_the_reference_drafter(trained, tmp_path):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3ForCausalLM
    target, drafter, _, prompts, _, _ = trained
    tdir, ddir = save_target(target, tmp_path / "t"), save_drafter(drafter, tmp_path / "d")
    hf = Qwen3ForCausalLM.from_pretrained(tdir).eval()
    x = torch.tensor([prompts[0]])
    with torch.no_grad():
        ours, _ = target.causal_forward(x)
        assert_fp32_close(target.logits(ours), hf(x).logits)
    ref = DFlashDraftModel.from_pretrained(ddir)
    assert ref.target_layer_ids == list(drafter.cfg.target_layer_ids) and ref.block_size == 8
    torch.testing.assert_close(ref.fc.weight, drafter.fc)


def test_train_drafter_cli(tiny_target, tmp_path):
    d, _ = tiny_target
    out = tmp_path / "cli-drafter"
    r = subprocess.run([sys.executable, "-m", "flashpd.cli", "train-drafter", "--target", str(d), "--out", str(out),
                        "--steps", "4", "--num-prompts", "6", "--new-tokens", "12", "--prompt-len", "6,20",
                        "--anchors", "8", "--seqs-per-step", "2", "--eval-prompts", "2", "--layers", "1",
                        "--taps", "2", "--block-size", "4", "--device", "cpu"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    ev = json.loads((out / "eval.json").read_text())
    assert len(ev["heldout"]) == 2 and all(row["exact"] for row in ev["heldout"])
    assert ev["eval_prompts"] in ("random token prompts", "windows of the held-out stdlib files (never trained on)")
    assert "drafter step 3 loss" in r.stdout


def test_train_drafter_cli_on_the_demo_target_evaluates_on_held_out_files(tmp_path):
    """The stdlib path end to end (the demo target has a tokenizer): a few steps, then evaluation on
    windows of the held-out files, which the report names."""
    from flashpd.demo import PAIR
    out = tmp_path / "demo-drafter"
    r = subprocess.run([sys.executable, "-m", "flashpd.cli", "train-drafter", "--target", str(PAIR / "target"),
                        "--out", str(out), "--steps", "2", "--num-prompts", "4", "--new-tokens", "8",
                        "--prompt-len", "16,48", "--anchors", "4", "--seqs-per-step", "2", "--eval-prompts", "2",
                        "--layers", "1", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads((out / "eval.json").read_text())
    assert ev["eval_prompts"] == "windows of the held-out stdlib files (never trained on)"
    assert len(ev["heldout"]) == 2 and all(row["exact"] for row in ev["heldout"])


def test_train_drafter_default_data_never_trains_on_the_held_out_files(tmp_path):
    """The stdlib default trains on the recipe's drafter-prompt files and evaluates on its held-out ones;
    a --data directory serves both, and the report says so."""
    from flashpd.training.text_data import drafter_prompt_sources, split_files, split_three, stdlib_files
    from flashpd.training.text_data import corpus_files
    train, held, what = drafter_prompt_sources()
    assert train == split_three(corpus_files())[1] and held == split_files(stdlib_files())[1]
    assert set(train).isdisjoint(held) and "held-out" in what
    (tmp_path / "a.py").write_text("x = 1\n")
    train, held, what = drafter_prompt_sources(str(tmp_path))
    assert train == held == [tmp_path / "a.py"] and "same files" in what
    assert drafter_prompt_sources(str(tmp_path / "a.py"))[0] == [tmp_path / "a.py"]  # one file will do
    (tmp_path / "empty").mkdir()
    for bad, why in ((tmp_path / "nope", "no such file or directory"), (tmp_path / "empty", "with no files")):
        with pytest.raises(ValueError, match=why):
            drafter_prompt_sources(str(bad))


def test_text_split_is_three_disjoint_parts_and_tokenizer_round_trips():
    from flashpd.training.text_data import SPECIAL_TOKENS, read_texts, split_files, split_three, stdlib_files, \
        train_tokenizer
    files = stdlib_files()
    a, b, c = split_three(files)
    assert set(a).isdisjoint(b) and set(a).isdisjoint(c) and set(b).isdisjoint(c)
    assert sorted(a + b + c) == sorted(files) and c == split_files(files)[1] and b and c
    texts = read_texts(a[:20])
    tok = train_tokenizer(texts, 600)
    assert tok.token_to_id(SPECIAL_TOKENS[1]) is not None
    assert tok.decode(tok.encode(texts[0][:500]).ids) == texts[0][:500]


def test_corpus_adds_torch_source_to_every_part_and_keeps_the_stdlib_split():
    """The recipe's corpus (stdlib + torch's Python) splits both roots three ways; its stdlib files fall
    exactly where the stdlib-only split puts them, so the held-out stdlib prompts stay never trained on."""
    from flashpd.training.text_data import corpus_files, split_three, stdlib_files, torch_files
    tf = torch_files()
    assert len(tf) > 500 and all(p.suffix == ".py" for p in tf)
    parts = split_three(corpus_files())
    std_parts = split_three(stdlib_files())
    tset = set(tf)
    for part, std in zip(parts, std_parts):
        assert [p for p in part if p not in tset] == std
        assert any(p in tset for p in part)
    with pytest.raises(ValueError, match="unknown corpus"):
        corpus_files("wiki")


def test_regenerate_keeps_the_prompt_order_and_equals_greedy_decoding(tiny_target):
    """Prompts go in batches sorted by length; each result is still its own prompt's greedy continuation."""
    _, target = tiny_target
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in (30, 3, 17, 8, 25, 5)]
    data = regenerate(target, prompts, 12, batch=2, log=lambda m: None)
    runner = ModelRunner(target, 64, 16)
    ref = NativeGenerator(runner, target.cfg.eos_token_ids)
    for p, d in zip(prompts, data):
        s = generate(ref, [p], [SamplingParams(max_tokens=12)])[0]
        assert d == p + s.output


def test_kl_term_is_the_targets_next_token_distribution_against_the_drafter(trained):
    """block_loss with kl_weight adds, per label position p, KL(softmax(target logits at p - 1) || drafter),
    under the same position weights: checked against the target's own full-sequence logits."""
    import torch.nn.functional as F

    from flashpd.training.train_drafter import _pad, block_loss, target_features
    target, drafter, _, prompts, data, _ = trained
    seqs, lengths = _pad(data[:3], "cpu")
    starts = torch.tensor([len(p) - 1 for p in prompts[:3]])
    c = drafter.cfg
    feats = target_features(target, tuple(c.target_layer_ids), seqs, final=True)
    nf = len(c.target_layer_ids) * c.hidden_size
    gamma, k = 5.0, 6

    def loss(w):
        return block_loss(drafter, target, seqs, lengths, starts, k, gamma, torch.Generator().manual_seed(9),
                          feats[..., :nf], feats[..., nf:], w)
    with torch.no_grad():
        l0, l1 = loss(0.0), loss(0.5)
        # the same anchors, by hand
        lo, hi = starts.float(), (lengths - 1).clamp_min(starts + 1).float()
        a = (lo[:, None] + torch.rand(3, k, generator=torch.Generator().manual_seed(9)) * (hi - lo)[:, None]).long()
        student = F.log_softmax(block_logits(drafter, target, seqs, a, feats[..., :nf]).float(), -1)
        full = F.log_softmax(target.logits(target.causal_forward(seqs)[0]).float(), -1)  # [S, N, V]: token p+1
        offs = torch.arange(1, c.block_size)
        lpos = a[:, :, None] + offs
        valid = lpos < lengths[:, None, None]
        src = (lpos - 1).clamp_max(seqs.shape[1] - 1)
        teacher = torch.stack([full[i, src[i]] for i in range(3)])
        kl = (teacher.exp() * (teacher - student)).sum(-1)
        w = torch.exp(-(offs.float() - 1) / gamma)[None, None, :] * valid
        expect = 0.5 * (kl * w).sum() / w.sum()
    assert expect > 1e-3
    torch.testing.assert_close(l1 - l0, expect, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="teacher"):
        block_loss(drafter, target, seqs, lengths, starts, k, gamma, torch.Generator(), feats[..., :nf], None, 0.5)


def test_drafter_training_with_the_kl_term_lowers_its_loss(tiny_target, tmp_path):
    _, target = tiny_target
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (16,), generator=g)]
    data = regenerate(target, prompts, 24, log=lambda m: None)
    logs: list[str] = []
    tc = DrafterTrainConfig(layers=1, block_size=8, num_taps=2, steps=30, seqs_per_step=4, anchors=16, lr=3e-3,
                            save_every=30, kl_weight=1.0)
    train_drafter(target, data, [len(p) for p in prompts], tmp_path, tc, log=logs.append)
    losses = _losses(logs)
    assert losses[-1] < 0.7 * losses[0], losses
    assert json.loads((tmp_path / "train_config.json").read_text())["kl_weight"] == 1.0


def test_wider_draft_mlp_starts_as_the_narrow_copy_and_decodes_exactly(tiny_target, tmp_path):
    """--drafter-intermediate: the extra MLP units start silent, so a wide drafter's first draft equals the
    target-width one's; it saves, loads back with its width, and DFlash with it equals native greedy."""
    from flashpd.engine.drafter import dummy_drafter
    from flashpd.training.train_drafter import drafter_config_for, init_from_target
    _, target = tiny_target
    made = []
    for width in (None, 2 * target.cfg.intermediate_size):
        tc = DrafterTrainConfig(layers=1, block_size=8, num_taps=2, intermediate_size=width)
        d = dummy_drafter(drafter_config_for(target, tc), target, seed=5).float()
        d.attach(target)
        init_from_target(d, target)
        made.append(d)
    narrow, wide = made
    assert wide.cfg.intermediate_size == 2 * narrow.cfg.intermediate_size
    assert wide.layers[0].down_proj[:, narrow.cfg.intermediate_size:].abs().sum() == 0
    g = torch.Generator().manual_seed(4)
    seqs = torch.randint(0, 250, (2, 30), generator=g)
    anchors = torch.tensor([[5, 12], [9, 20]])
    with torch.no_grad():
        torch.testing.assert_close(block_logits(wide, target, seqs, anchors), block_logits(narrow, target, seqs, anchors))
    with torch.no_grad():  # then make the extra units matter before the round trip
        wide.layers[0].down_proj.normal_(0, 0.02, generator=g)
    out = save_drafter(wide, tmp_path / "wide")
    loaded = load_drafter(out, target)
    assert loaded.cfg.intermediate_size == wide.cfg.intermediate_size
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (7, 19)]
    runner = ModelRunner(target, 64, 16, taps=tuple(loaded.cfg.target_layer_ids))
    params = [SamplingParams(max_tokens=20, ignore_eos=True)] * 2
    spec = generate(DFlashGenerator(runner, loaded, target.cfg.eos_token_ids), prompts, params)
    native = generate(NativeGenerator(runner, target.cfg.eos_token_ids), prompts, params)
    assert [s.output for s in spec] == [n.output for n in native]


def test_draft_gap_block_accuracy_counts_runs_of_right_guesses(trained):
    """bench/draft_gap: per block position, the share of whole blocks (all labels inside the sequence)
    whose first k guesses are all right, checked against a block-by-block count."""
    from flashpd.bench.draft_gap import block_accuracy
    target, drafter, _, prompts, data, _ = trained
    starts = [len(p) - 1 for p in prompts[:10]]
    b, span, stride = drafter.cfg.block_size, 40, 3  # blocks run past some sequences' ends
    got = block_accuracy(target, drafter, data[:10], starts, span, stride)
    hits, count = [0] * (b - 1), 0
    for seq, a0 in zip(data[:10], starts):
        for a in range(a0, a0 + span - b, stride):
            if a + b - 1 >= len(seq):
                continue
            with torch.no_grad():
                guess = block_logits(drafter, target, torch.tensor([seq]), torch.tensor([[a]]))[0, 0].argmax(-1)
            run = 0
            while run < b - 1 and guess[run].item() == seq[a + 1 + run]:
                run += 1
            hits = [h + (k < run) for k, h in enumerate(hits)]
            count += 1
    assert count > 20 and 0 < got[0] < 1
    assert got == pytest.approx([h / count for h in hits])


def test_target_training_reduces_loss():
    from flashpd.engine.config import Qwen3Config
    from flashpd.training.train_target import train_target
    cfg = Qwen3Config.from_dict({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16})
    stream = torch.arange(2000) % 17  # a learnable periodic stream
    logs: list[str] = []
    train_target(cfg, stream, steps=60, batch=4, seq_len=32, lr=1e-2, device="cpu", log=logs.append)
    losses = _losses(logs)
    assert losses[-1] < 0.3 * losses[0], losses


def test_target_training_keeps_the_best_validation_weights():
    """Validation on a stream the model never trains on picks the returned weights."""
    from flashpd.engine.config import Qwen3Config
    from flashpd.training.train_target import train_target, validation_loss
    cfg = Qwen3Config.from_dict({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16})
    train, val = torch.arange(2000) % 17, (torch.arange(2000) * 5) % 23  # val follows another rule
    logs: list[str] = []
    model = train_target(cfg, train, steps=40, batch=4, seq_len=32, lr=1e-2, device="cpu", val_stream=val,
                         eval_every=10, log=logs.append)
    vals = [float(m.split(" val ")[1].split()[0]) for m in logs if " val " in m]
    assert len(vals) == 5 and logs[-1].startswith("kept the weights with the lowest validation loss")
    assert f"({min(vals):.4f})" in logs[-1]
    from flashpd.training.train_target import random_windows
    fixed = random_windows(val, 4, 32, torch.Generator().manual_seed(1))  # the batch train_target validates on
    assert abs(validation_loss(model, fixed, torch.autocast("cpu", enabled=False)) - min(vals)) < 1e-4


def test_shipped_demo_pair_is_exact_on_heldout_prompts():
    """The README's demo pair: DFlash equals native greedy in float32 on held-out text."""
    from flashpd.demo import heldout_prompts
    from flashpd.llm import LLM
    spec = LLM(target=DEMO / "target", draft=DEMO / "drafter", device="cpu", dtype="float32")
    assert spec.tokenizer is not None and spec.block_size == 16
    prompts = heldout_prompts(spec.encode, n=2, tokens=120)
    assert len(prompts) == 2
    native = NativeGenerator(spec.runner, spec.stop_ids)
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 2
    for s, n in zip(generate(spec.generator, prompts, params), generate(native, prompts, params)):
        assert s.output == n.output and s.stats.tau >= 1.0
    # the pair and its tokenizer: at most 16 MB together (it travels to the GPU machine within a 64 MiB carry),
    # in two weight files
    weights = sum(f.stat().st_size for f in DEMO.rglob("*.safetensors"))
    assert len(list(DEMO.rglob("*.safetensors"))) == 2
    assert weights + (DEMO / "target" / "tokenizer.json").stat().st_size <= 16e6


def test_profile_step_times_dflash_steps_at_the_drafters_block_width():
    """bench/profile_step: a DFlash request it times drafts blocks of the drafter's width (it once ran
    width 1, a native step with extra work), so on held-out text the demo pair accepts guesses there."""
    from flashpd.bench.profile_step import _ready, measure_loop
    from flashpd.training.demo_recipe import heldout_long_prompts
    from flashpd.engine.tokenizer import TextTokenizer
    target = load_target(DEMO / "target", "cpu", torch.float32)
    drafter = load_drafter(DEMO / "drafter", target)
    runner = ModelRunner(target, 256, 16, taps=tuple(drafter.cfg.target_layer_ids))
    spec = DFlashGenerator(runner, drafter, (), 16)
    prompt = heldout_long_prompts(TextTokenizer.from_dir(DEMO / "target")._tok, 1, 128)[0]
    seqs = _ready(spec, prompt, 8)
    assert seqs[0].draft_width == 16
    spec.finish(seqs[0])
    row = measure_loop(spec, prompt, 48, 1, cuda=False)
    assert row["steps"] < 47 and row["tau"] > 1.0


def test_tau_within_counts_the_steps_that_made_the_first_tokens():
    from flashpd.training.train_drafter import tau_within
    assert tau_within([3, 1, 5, 16, 16], 8) == 8 / 3  # the third step passes 8 tokens: capped there
    assert tau_within([3, 1, 5, 16, 16], 64) == 41 / 5  # fewer tokens than n: all steps
    assert tau_within([], 64) is None


def test_recipe_from_scratch_makes_a_pair_that_loads_and_evaluates(tmp_path):
    """make-demo-pair with no --target, shrunk: tokenizer (saved compact), target trained from scratch (its
    validation loss falls), regenerated data, drafter, evaluation; the pair reloads as users load it."""
    from tokenizers import Tokenizer

    from flashpd.training.demo_recipe import make_demo_pair
    logs: list[str] = []
    report = make_demo_pair(tmp_path / "pair", "cpu", target_steps=3, target_batch=2, seq_len=256, drafter_steps=2,
                            num_prompts=4, new_tokens=8, heldout_prompts=2, vocab_size=512, drafter_seqs=2,
                            regen_batch=4, corpus="stdlib", eval_tokens=32, max_files=40, log=logs.append)
    vals = [float(m.split(" val ")[1].split()[0]) for m in logs if m.startswith("target step")]
    assert len(vals) >= 2 and vals[-1] < vals[0]
    tok = tmp_path / "pair" / "target" / "tokenizer.json"
    assert b"\n" not in tok.read_bytes() and Tokenizer.from_file(str(tok)).get_vocab_size() == 512
    target = load_target(tmp_path / "pair" / "target")
    assert target.cfg.vocab_size == 512 and report["recipe"]["target_steps"] == 3
    assert report["recipe"]["max_files"] == 40 and any(m.startswith("data: 40 target files") for m in logs)
    load_drafter(tmp_path / "pair" / "drafter", target)
    assert report["exact"] == "2/2" and all(r["tau"] >= 1.0 for r in report["heldout"])


def test_recipe_on_a_given_target_copies_it_and_trains_only_the_drafter(tmp_path):
    """make-demo-pair --target: the shipped demo target is copied in unchanged (no target training),
    its own tokenizer cuts the prompts, and a drafter is trained, saved, reloaded and evaluated."""
    from flashpd.training.demo_recipe import make_demo_pair
    logs: list[str] = []
    report = make_demo_pair(tmp_path / "pair", "cpu", drafter_steps=2, num_prompts=4, new_tokens=8,
                            heldout_prompts=2, drafter_seqs=2, regen_batch=4, target_dir=DEMO / "target",
                            corpus="stdlib", drafter_gamma=5.0, eval_tokens=32, max_files=40, seq_len=256,
                            log=logs.append)
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "pair" / "target" / f).read_bytes() == (DEMO / "target" / f).read_bytes()
    assert not any("target step" in m for m in logs) and any("target reused" in m for m in logs)
    assert report["recipe"]["target_from"] == str(DEMO / "target") and report["recipe"]["target_steps"] is None
    assert report["recipe"]["drafter"]["gamma"] == 5.0
    assert json.loads((tmp_path / "pair" / "drafter-train" / "train_config.json").read_text())["gamma"] == 5.0
    target = load_target(tmp_path / "pair" / "target")
    load_drafter(tmp_path / "pair" / "drafter", target)  # fits the reused target
    saved = json.loads((tmp_path / "pair" / "eval.json").read_text())
    assert len(saved["heldout"]) == 2 and all(r["tau_64"] >= 1.0 for r in saved["heldout"])
    assert saved["tau_64_mean"] == sum(r["tau_64"] for r in saved["heldout"]) / 2


def test_recipe_refuses_a_file_limit_too_small_before_training(tmp_path):
    """make-demo-pair --max-files: 0 is refused at once; one file a part is too little text for the drafter's
    prompt windows, which the recipe says (naming max_files) instead of failing inside torch.randint."""
    from flashpd.training.demo_recipe import make_demo_pair
    with pytest.raises(ValueError, match="max_files must be at least 1"):
        make_demo_pair(tmp_path / "a", "cpu", max_files=0)
    with pytest.raises(ValueError, match="too few for windows.*max_files"):
        make_demo_pair(tmp_path / "b", "cpu", drafter_steps=1, num_prompts=2, new_tokens=8, heldout_prompts=1,
                       drafter_seqs=1, regen_batch=2, target_dir=DEMO / "target", corpus="stdlib", max_files=1,
                       eval_tokens=8, log=lambda m: None)


def test_demo_prints_no_figure_from_a_file_the_wheel_does_not_ship():
    """`flashpd demo` measures on this machine and points to docs/results.md for the GPU figures: it must not
    quote figures or result paths (the wheel ships neither bench/results nor docs)."""
    from flashpd import demo
    src = Path(demo.__file__).read_text()
    assert "bench/results" not in src and not re.search(r"\bx\d+\.\d+", src)
    assert not any(hasattr(demo, n) for n in ("SPEEDUP_JSON", "SPEEDUP_GEOMEAN", "SPEEDUP_RANGE"))


def test_demo_explains_a_difference_by_the_two_tokens_float32_logits(make_checkpoint):
    """Where bf16 DFlash and native part, the demo prints both tokens' float32 logits there (from a float32
    copy of the weights, as transformers computes them), the top-2 gap and one bf16 step."""
    from conftest import hf_greedy, hf_logits, random_prompts

    from flashpd.demo import explain_difference, float32_logits
    hf, path = make_checkpoint()
    prompt = random_prompts([20], hf.config.vocab_size, seed=3)[0]
    native = hf_greedy(hf, prompt, 6)
    ref = hf_logits(hf, prompt + native[:3])[-1]
    runner_up = ref.topk(2).indices[1].item()
    dflash = native[:3] + [runner_up, native[4]]
    model = load_target(path, "cpu", torch.bfloat16)
    assert float32_logits(model, prompt).dtype == torch.float32 and next(model.parameters()).dtype == torch.bfloat16
    msg = explain_difference(load_target(path, "cpu", torch.float32), prompt, native, dflash)
    assert f"parts at new token 3: native took id {native[3]}, DFlash id {runner_up}" in msg
    got = [float(x) for x in re.search(r"there (\S+) and (\S+) \(gap (\S+); top-2 gap (\S+);", msg).groups()]
    gap = (ref[native[3]] - ref[runner_up]).item()
    assert got == pytest.approx([ref[native[3]].item(), ref[runner_up].item(), abs(gap), gap], abs=2e-3)
    assert explain_difference(model, prompt, native, native) == "equal"
    assert "prefix" in explain_difference(model, prompt, native, native[:4])


def test_demo_runs_on_cpu_and_fails_loudly_if_float32_dflash_differs(monkeypatch, capsys):
    """`flashpd demo` on the CPU (float32): three prompts, DFlash identical to native, exit 0 (24 tokens each,
    to keep the suite's time: exactness at length is test_dflash_exact's). A DFlash output corrupted at one
    token (what a broken verify would give) is reported with its float32 logits and exits 1."""
    from flashpd import demo
    from flashpd.llm import LLM
    assert demo.run_demo("cpu", max_tokens=24) == 0
    out = capsys.readouterr().out
    assert out.count("identical to native: True") == 3 and "differ" not in out and "float32" in out.splitlines()[0]
    real = LLM.generate

    def corrupted(self, prompts, params=None):
        outs = real(self, prompts, params)
        if self.drafter is not None:
            for o in outs:
                o.token_ids[5] = (o.token_ids[5] + 1) % self.model.cfg.vocab_size
        return outs

    monkeypatch.setattr(LLM, "generate", corrupted)
    assert demo.run_demo("cpu", max_tokens=8) == 1  # the failure path: 8 tokens reach the corrupted one
    out = capsys.readouterr().out
    assert out.count("identical to native: False") == 3 and out.count("parts at new token 5") == 3
    assert "in float32: that is a bug" in out


def test_demo_eval_scores_a_given_drafter_on_the_pairs_target(tmp_path):
    """bench/demo_eval --drafter: a candidate drafter judged on the pair's target and prompts (how v4's
    candidates compared on the CPU); the JSON names the drafter and the command that reproduces it."""
    out = tmp_path / "eval.json"
    drafter = DEMO / "drafter"
    subprocess.run([sys.executable, "-m", "flashpd.bench.demo_eval", "--device", "cpu", "--prompts", "1",
                    "--max-tokens", "8", "--seed", "1", "--drafter", str(drafter), "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    run = json.loads(out.read_text())
    # (write_json keeps paths repository-relative)
    assert run["drafter"].endswith("demo_pair/drafter") and "--drafter " in run["command"] and "--seed 1" in run["command"]
    assert run["exact"] == "1/1" and run["max_tokens"] == 8 and run["prompts"][0]["tau"] >= 1.0


def test_target_training_refuses_text_shorter_than_a_window_before_any_step():
    """make-demo-pair --max-files 2 gave 1,349 tokens for 2,048-token windows: torch's random_ failed with
    'from=0 >= to=-705' after the tokenizer's work; the check now names the text and the fix."""
    from flashpd.engine.config import Qwen3Config
    from flashpd.training.train_target import train_target

    cfg = Qwen3Config.from_dict({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "head_dim": 16, "max_position_embeddings": 256})
    short = torch.arange(40) % 64
    with pytest.raises(ValueError, match="training text has 40 tokens, too few for 64-token windows"):
        train_target(cfg, short, steps=1, batch=2, seq_len=64, lr=1e-3, device="cpu")
    with pytest.raises(ValueError, match="validation text has 40 tokens"):
        train_target(cfg, torch.arange(400) % 64, steps=1, batch=2, seq_len=64, lr=1e-3, device="cpu",
                     val_stream=short)


def test_resume_refuses_weights_and_state_of_two_saves(trained, tmp_path):
    """A save cut short between its files left step N's weights beside an earlier save's optimizer state, and
    --resume paired them silently; the trainer state now names the save that wrote the weights."""
    import shutil

    from flashpd.engine.config import CheckpointError
    from flashpd.engine.export import save_drafter
    from flashpd.training.train_drafter import SAVE_ID_KEY

    target, drafter, out, prompts, data, _ = trained
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    save_drafter(drafter, cut, metadata={SAVE_ID_KEY: "41-another-save"})  # the next save's weights, then the stop
    tc = DrafterTrainConfig(layers=1, block_size=8, num_taps=2, steps=45, seqs_per_step=4, anchors=16, lr=3e-3)
    with pytest.raises(CheckpointError, match="cut short"):
        train_drafter(target, data, [len(p) for p in prompts], cut, tc, resume=True, log=lambda m: None)
    save_drafter(drafter, cut)  # an untagged file (weights written by another tool) is refused the same way
    with pytest.raises(CheckpointError, match="untagged"):
        train_drafter(target, data, [len(p) for p in prompts], cut, tc, resume=True, log=lambda m: None)

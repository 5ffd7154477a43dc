"""A reduced draft vocabulary (engine/token_map.py): files refused with clear errors, and drafting from hot ids
only never changes the output.

float32 CPU, the tiny fixture pair. A map of every id must draft exactly what no map drafts (tokens and acceptance
lengths, against the reference package too); a reduced map must keep the output equal to native greedy decoding,
on the device step, the confidence cut's host step and the CLI; and a map that holds none of the tokens the target
emits must get no guess accepted (tau exactly 1), which shows the map really restricts what the drafter proposes.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from _dflash_helpers import (  # noqa: F401  (fixtures are used by name)
    dflash_engine, dflash_pair, greedy, reference_generate, run_checked)
from flashpd.cli import main as cli_main, parse_speculative_config
from flashpd.engine.drafter import load_drafter
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.engine.token_map import (TokenMapError, build_token_map, load_token_map, parse_token_ids,
                                      save_token_map)
from flashpd.engine.width_policy import ConfidenceWidth
from flashpd.training.token_map import main as build_main

PROMPTS = slice(0, 8)
MAX_TOKENS = 40


# ---- the file ----------------------------------------------------------------------------------------

def test_ids_are_sorted_and_validated():
    assert parse_token_ids([5, 1, 3], 8, "m").tolist() == [1, 3, 5]
    for ids, words in [([], "empty"), ([1, 8], "outside"), ([-1, 2], "outside"), ([2, 2], "more than once"),
                       ([[1, 2]], "1-D"), ([0.5, 1.0], "integers"), ("abc", "not a list")]:
        with pytest.raises(TokenMapError, match=words):
            parse_token_ids(ids, 8, "m")


def test_files_load_and_bad_files_are_refused(tmp_path):
    j = tmp_path / "m.json"
    save_token_map(torch.tensor([4, 0, 2]), j)
    assert load_token_map(j, 8).tolist() == [0, 2, 4]
    pt = tmp_path / "m.pt"  # SGLang's form: a torch file of ids
    torch.save(torch.tensor([7, 3]), pt)
    assert load_token_map(pt, 8).tolist() == [3, 7]
    torch.save([1, 6], tmp_path / "l.pt")
    assert load_token_map(tmp_path / "l.pt", 8).tolist() == [1, 6]
    bad = {"missing.json": None, "trunc.json": "[1, 2", "obj.json": '{"ids": [1]}', "bools.json": "[true]",
           "junk.pt": b"not a torch file"}
    for name, body in bad.items():
        p = tmp_path / name
        if isinstance(body, bytes):
            p.write_bytes(body)
        elif body is not None:
            p.write_text(body)
        with pytest.raises(TokenMapError, match=name.split(".")[0] if body is None else str(p.name)):
            load_token_map(p, 8)
    with pytest.raises(TokenMapError, match="outside the target's vocabulary"):
        load_token_map(j, 4)


def test_build_keeps_the_most_counted_and_the_stop_ids():
    counts = torch.tensor([5, 0, 9, 5, 1, 0])
    assert build_token_map(counts, 3).tolist() == [0, 2, 3]  # 9, then the two 5s
    assert build_token_map(counts, 3, always=[5]).tolist() == [0, 2, 5]  # a stop id displaces the last 5
    with pytest.raises(ValueError, match="size"):
        build_token_map(counts, 0)
    with pytest.raises(ValueError, match="smaller than"):
        build_token_map(counts, 1, always=[1, 5])


def test_builder_counts_a_corpus_under_the_target_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"a": 0, "b": 1, "c": 2, "d": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = tmp_path / "target"
    t.mkdir()
    tok.save(str(t / "tokenizer.json"))
    (t / "config.json").write_text(json.dumps({"vocab_size": 6, "eos_token_id": 5}))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "one.txt").write_text("c c c a b c")
    (tmp_path / "two.md").write_text("a a d")
    out = tmp_path / "map.json"
    assert build_main(["--target", str(t), "--size", "3", "--out", str(out),
                       "--text", str(tmp_path / "text"), str(tmp_path / "two.md")]) == 0
    assert json.loads(out.read_text()) == [0, 2, 5]  # c (4), a (3), and the stop id
    kept = out.read_bytes()
    force = ["--force"]
    assert build_main(["--target", str(t), "--size", "3", "--out", str(out), "--text", str(tmp_path / "nope"),
                       *force]) == 2
    assert build_main(["--target", str(t), "--size", "9", "--out", str(out), "--text", str(tmp_path / "two.md"),
                       *force]) == 2
    assert out.read_bytes() == kept  # a refused run leaves the old map


def test_building_a_map_refuses_what_would_lose_a_file_or_fail_after_the_count(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = tmp_path / "target"
    t.mkdir()
    tok.save(str(t / "tokenizer.json"))
    (t / "config.json").write_text(json.dumps({"vocab_size": 3, "eos_token_id": 2}))
    (tmp_path / "text.txt").write_text("a b a")
    (tmp_path / "empty.txt").write_text("")
    tokenizer = (t / "tokenizer.json").read_bytes()

    def run(out, *more, text="text.txt"):
        return build_main(["--target", str(t), "--size", "2", "--out", str(out), "--text", str(tmp_path / text),
                           *more])
    assert run(t / "tokenizer.json") == 2 and "exists; pass --force" in capsys.readouterr().err
    assert (t / "tokenizer.json").read_bytes() == tokenizer  # the target's own file, untouched
    assert run(tmp_path) == 2 and "exists" in capsys.readouterr().err  # a directory, even with --force
    assert run(tmp_path / "no" / "map.json") == 2 and "no directory" in capsys.readouterr().err
    assert run(tmp_path / "m.json", text="empty.txt") == 2 and "hold no tokens" in capsys.readouterr().err
    assert build_main(["--target", str(tmp_path / "none"), "--size", "2", "--out", str(tmp_path / "m.json"),
                       "--text", str(tmp_path / "text.txt")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
    assert run(tmp_path / "m.json") == 0 and json.loads((tmp_path / "m.json").read_text()) == [0, 2]
    assert run(tmp_path / "m.json", "--force") == 0


# ---- drafting under a map ------------------------------------------------------------------------------

def _drafter_with(engine, pair, ids):
    d = load_drafter(pair.draft_dir, engine.target)
    d.set_token_map(None if ids is None else parse_token_ids(ids, engine.vocab, "test map"))
    return d


def _run(engine, drafter, prompts, width=16, policy=None):
    gen = DFlashGenerator(engine.runner, drafter, draft_width=width, width_policy=policy)
    return run_checked(gen, prompts, [greedy(MAX_TOKENS)] * len(prompts))


@pytest.fixture(scope="module")
def case(dflash_engine, dflash_pair):
    prompts = dflash_pair.prompts[PROMPTS]
    native = dflash_engine.native(prompts, MAX_TOKENS)
    emitted = Counter(t for o in native for t in o)
    return prompts, native, emitted


def test_head_rows_and_mapping(dflash_engine, dflash_pair):
    d = _drafter_with(dflash_engine, dflash_pair, [9, 2, 40])
    w = dflash_engine.target.head_weight
    assert torch.equal(d.head_weight, w[[2, 9, 40]]) and d.head_weight.is_contiguous()
    assert d.target_ids(torch.tensor([[0, 2, 1]])).tolist() == [[2, 40, 9]]
    full = d.full_logits(torch.tensor([[1.0, 3.0, 2.0]]))
    assert full.shape == (1, dflash_engine.vocab) and full.argmax(-1).item() == 9
    assert torch.isinf(full).sum() == dflash_engine.vocab - 3
    d.set_token_map(None)
    assert d.head_weight is w and d.hot_ids is None


def test_the_draft_head_takes_one_contiguous_matrix(monkeypatch):
    """block_head hands the head one [B*(T-1), H] matrix: a strided [B, T-1, H] view went to a batched matmul on the
    GPU that read the whole head once per row (docs/results.md, 2026-12-04). Same values either way."""
    from flashpd.engine import drafter as drafter_mod

    seen = []
    real = drafter_mod.linear

    def recording(x, w):
        seen.append((tuple(x.shape), x.is_contiguous()))
        return real(x, w)

    monkeypatch.setattr(drafter_mod, "linear", recording)
    x, w = torch.randn(3, 5, 8), torch.randn(11, 8)
    got = drafter_mod.block_head(x, w, 1.0, None)
    assert seen == [((12, 8), True)]
    assert got.shape == (3, 4, 11) and torch.allclose(got, x[:, 1:] @ w.T, atol=1e-6)


def test_a_map_of_every_id_drafts_what_no_map_drafts(dflash_engine, dflash_pair, case):
    prompts, native, _ = case
    every = _run(dflash_engine, _drafter_with(dflash_engine, dflash_pair, range(dflash_engine.vocab)), prompts)
    plain = _run(dflash_engine, _drafter_with(dflash_engine, dflash_pair, None), prompts)
    assert [s.output for s in every] == native == [s.output for s in plain]
    assert [s.stats.acceptance_lengths for s in every] == [s.stats.acceptance_lengths for s in plain]
    p = prompts[0]
    assert (every[0].output, every[0].stats.acceptance_lengths) == reference_generate(dflash_pair, p, MAX_TOKENS)


@pytest.mark.parametrize("width", [4, 16])
def test_a_reduced_map_keeps_the_output_exact(dflash_engine, dflash_pair, case, width):
    prompts, native, emitted = case
    hot = [t for t, _ in emitted.most_common(len(emitted) // 2)]  # half the tokens the target emits
    seqs = _run(dflash_engine, _drafter_with(dflash_engine, dflash_pair, hot), prompts, width)
    assert [s.output for s in seqs] == native
    al = [a for s in seqs for a in s.stats.acceptance_lengths]
    assert sum(al) / len(al) > 1.2, "nothing accepted: exactness would hold trivially"


def test_a_reduced_map_keeps_the_confidence_cut_exact(dflash_engine, dflash_pair, case):
    prompts, native, emitted = case
    hot = [t for t, _ in emitted.most_common(len(emitted) // 2)]
    policy = ConfidenceWidth(threshold=0.3, cut_from_batch=1)
    gen = DFlashGenerator(dflash_engine.runner, _drafter_with(dflash_engine, dflash_pair, hot), width_policy=policy)
    seqs = run_checked(gen, prompts, [greedy(MAX_TOKENS)] * len(prompts))
    assert [s.output for s in seqs] == native
    assert gen.width_stats.cut_steps > 0, "the host step never ran"


def test_a_map_without_the_emitted_tokens_gets_nothing_accepted(dflash_engine, dflash_pair, case):
    prompts, native, emitted = case
    cold = [t for t in range(dflash_engine.vocab) if t not in emitted]
    assert cold, "the target emitted every id: no cold map to test with"
    seqs = _run(dflash_engine, _drafter_with(dflash_engine, dflash_pair, cold), prompts)
    assert [s.output for s in seqs] == native
    assert all(a == 1 for s in seqs for a in s.stats.acceptance_lengths)
    plain = _run(dflash_engine, _drafter_with(dflash_engine, dflash_pair, None), prompts)
    assert any(a > 1 for s in plain for a in s.stats.acceptance_lengths), "control: the drafter accepts without a map"


# ---- the public face ---------------------------------------------------------------------------------

def test_speculative_config_takes_a_token_map():
    spec = parse_speculative_config('{"method": "dflash", "model": "d", "token_map": "hot.json"}')
    assert spec["token_map"] == "hot.json"
    with pytest.raises(ValueError, match="token_map"):
        parse_speculative_config('{"method": "dflash", "model": "d", "token_map": 3}')


def test_cli_generate_with_a_token_map(dflash_engine, dflash_pair, case, tmp_path, capsys):
    prompts, native, emitted = case
    m = tmp_path / "hot.json"
    save_token_map(torch.tensor([t for t, _ in emitted.most_common(len(emitted) // 2)]), m)
    args = ["generate", "--target", str(dflash_pair.target_dir), "--draft", str(dflash_pair.draft_dir),
            "--prompt-ids", ",".join(map(str, prompts[1])), "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
            "--device", "cpu", "--dtype", "float32", "--json"]
    assert cli_main(args + ["--speculative-token-map", str(m)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["token_ids"] == native[1]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([0, dflash_engine.vocab]))
    assert cli_main(args + ["--speculative-token-map", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "outside the target's vocabulary" in err


def test_serve_config_refuses_a_map_without_a_drafter():
    from flashpd.cluster.config import ServeConfig

    with pytest.raises(ValueError, match="draft_token_map"):
        ServeConfig(target="t", draft_token_map="hot.json")
    assert ServeConfig(target="t", draft="d", draft_token_map="hot.json").draft_token_map == "hot.json"


def test_the_service_drafts_from_its_configured_map(tmp_path):
    """`flashpd serve` with draft_token_map (a real colocated server over gRPC, the demo pair): a map without the
    tokens the target emits for a prompt gets nothing accepted (so the server drafts from it), the output still
    equals native decoding; a request with method native on the same server is untouched."""
    from pathlib import Path

    from flashpd.cluster.generation_client import GenerationClient
    from flashpd.llm import LLM
    from tests._serve_process import serve_process

    demo = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"
    prompt, n = "def add(a, b):\n", 24
    llm = LLM(target=demo / "target", device="cpu", dtype="float32", kv_cache_tokens=1024)
    native = llm.generate([prompt], greedy(n))[0].token_ids
    cold = tmp_path / "cold.json"
    save_token_map(torch.tensor([t for t in range(llm.model.cfg.vocab_size) if t not in set(native)]), cold)
    cfg = tmp_path / "serve.json"
    cfg.write_text(json.dumps({"target": str(demo / "target"), "draft": str(demo / "drafter"),
                               "draft_token_map": str(cold), "device": "cpu", "dtype": "float32",
                               "kv_cache_tokens": 2048, "torch_threads": 1}))
    with serve_process([str(cfg)], start_timeout_s=90) as (address, _):
        with GenerationClient(address, timeout_s=60) as c:
            spec = c.generate_once(prompt, max_tokens=n, method="dflash", ignore_eos=True)
            plain = c.generate_once(prompt, max_tokens=n, method="native", ignore_eos=True)
    assert spec.token_ids == native == plain.token_ids
    assert spec.stats["acceptance_lengths"] and all(a == 1 for a in spec.stats["acceptance_lengths"])
    control = LLM(target=demo / "target", draft=demo / "drafter", device="cpu", dtype="float32",
                  kv_cache_tokens=1024).generate([prompt], greedy(n))[0]
    assert control.token_ids == native and max(control.stats.acceptance_lengths) > 1, "control: no map accepts"

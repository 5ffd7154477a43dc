"""train-drafter and make-demo-pair refuse what would lose work or fail minutes later, before loading anything:
an --out that is the target or holds other files (without --resume), a --resume with nothing to continue or with
other drafter settings than the checkpoint's, and counts or rates no run can use."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from flashpd.cli import main
from flashpd.demo import PAIR


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _train(target: Path, out: Path, *extra: str) -> list[str]:
    return ["train-drafter", "--target", str(target), "--out", str(out), "--device", "cpu", *extra]


@pytest.fixture
def target(tmp_path: Path) -> Path:
    shutil.copytree(PAIR / "target", tmp_path / "target")
    return tmp_path / "target"


def test_the_target_as_out_is_refused_and_left_whole(target, capsys):
    before = _tree(target)
    assert main(_train(target, target)) == 2
    assert "is the target's directory" in capsys.readouterr().err
    assert _tree(target) == before


def test_a_directory_with_files_is_refused_without_resume(target, tmp_path, capsys):
    out = tmp_path / "drafter"
    shutil.copytree(PAIR / "drafter", out)
    before = _tree(out)
    assert main(_train(target, out)) == 2
    assert "is not empty: pass --resume" in capsys.readouterr().err
    assert _tree(out) == before


def test_resume_needs_a_trainer_state_and_the_checkpoints_settings(target, tmp_path, capsys):
    out = tmp_path / "drafter"
    shutil.copytree(PAIR / "drafter", out)
    assert main(_train(target, out, "--resume")) == 2
    assert "holds no trainer_state.pt" in capsys.readouterr().err
    (out / "trainer_state.pt").write_bytes(b"")
    before = _tree(out)
    assert main(_train(target, out, "--resume", "--layers", "3", "--block-size", "8")) == 2
    err = capsys.readouterr().err
    assert "--layers 3 (the checkpoint's: 2)" in err and "--block-size 8 (the checkpoint's: 16)" in err
    assert _tree(out) == before


def test_resume_from_weights_of_another_save_is_refused_before_loading(target, tmp_path, capsys):
    """Refused inside the training only after the target loaded and the data was regenerated (118 s in a review's
    run); the CLI reads the trainer state and the weights' header first. An unreadable state is named too."""
    import torch
    out = tmp_path / "drafter"
    shutil.copytree(PAIR / "drafter", out)  # weights without a save id: not the save the state names
    torch.save({"step": 4, "optimizer": {}, "save_id": "4-abc"}, out / "trainer_state.pt")
    before = _tree(out)
    assert main(_train(target, out, "--resume")) == 2
    assert "is from another save (untagged) than trainer_state.pt (4-abc, step 4)" in capsys.readouterr().err
    (out / "trainer_state.pt").write_bytes(b"")
    assert main(_train(target, out, "--resume")) == 2
    assert "trainer_state.pt cannot be read" in capsys.readouterr().err
    assert _tree(out) == {**before, "trainer_state.pt": b""}


def test_a_missing_data_path_is_refused_before_loading(target, tmp_path, capsys):
    assert main(_train(target, tmp_path / "d", "--data", str(tmp_path / "nope"))) == 2
    assert "no such file or directory" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_make_demo_pair_refuses_to_merge_into_another_pair(tmp_path, capsys):
    other = tmp_path / "pair"
    shutil.copytree(PAIR, other)
    before = _tree(other)
    assert main(["make-demo-pair", "--out", str(other), "--target", str(PAIR / "target")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert _tree(other) == before


@pytest.mark.parametrize("command,option,value", [
    ("train-drafter", "--steps", "0"), ("train-drafter", "--steps", "-5"), ("train-drafter", "--anchors", "0"),
    ("train-drafter", "--layers", "0"), ("train-drafter", "--seqs-per-step", "0"), ("train-drafter", "--taps", "0"),
    ("train-drafter", "--num-prompts", "0"), ("train-drafter", "--eval-prompts", "-1"),
    ("train-drafter", "--intermediate-size", "0"), ("train-drafter", "--lr", "nan"), ("train-drafter", "--lr", "-1"),
    ("train-drafter", "--kl-weight", "inf"), ("train-drafter", "--prompt-len", "24,16"),
    ("train-drafter", "--prompt-len", "abc"), ("train-drafter", "--block-size", "1"),
    ("make-demo-pair", "--target-steps", "0"), ("make-demo-pair", "--drafter-steps", "0"),
    ("make-demo-pair", "--drafter-lr", "nan"), ("make-demo-pair", "--num-prompts", "0"),
])
def test_a_count_or_rate_no_run_can_use_is_refused_by_the_parser(command, option, value, tmp_path, capsys):
    args = (_train(PAIR / "target", tmp_path / "o") if command == "train-drafter"
            else ["make-demo-pair", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as e:
        main([*args, f"{option}={value}"])
    assert e.value.code == 2 and option in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

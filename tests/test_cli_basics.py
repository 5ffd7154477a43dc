"""What a new user meets first: `flashpd` alone prints its help, `--version` its version, and a CUDA
request on a machine without CUDA one clear line (no traceback)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flashpd.cli import main


def test_no_command_prints_the_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashpd") and "generate" in out and "serve" in out


def test_version():
    r = subprocess.run([sys.executable, "-m", "flashpd.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().startswith("flashpd 0.")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA: nothing to refuse")
def test_cuda_without_cuda_is_one_clear_line(capsys):
    assert main(["generate", "--target", "x", "--prompt", "hi", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


def test_serve_reports_a_bad_checkpoint_in_one_line(tmp_path, capsys):
    """Colocated `serve` loads in its engine process: a wrong target still comes back as one line, exit 2."""
    import json  # noqa: PLC0415

    (tmp_path / "c.json").write_text(json.dumps({"target": str(tmp_path / "nope"), "device": "cpu"}))
    assert main(["serve", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashpd: error: ") and "nope" in err and "Traceback" not in err, err
    assert main(["serve", str(tmp_path)]) == 2  # a directory given as the config file
    err = capsys.readouterr().err
    assert err.startswith("flashpd: error: ") and "Traceback" not in err, err


def test_engine_sizes_and_speculative_config_types_are_checked():
    from flashpd.cli import parse_speculative_config  # noqa: PLC0415
    from flashpd.engine.factory import load_engine  # noqa: PLC0415

    target = "flashpd/assets/demo_pair/target"
    for kw, said in ((dict(kv_block_size=0), "kv_block_size must be a positive integer"),
                     (dict(kv_cache_tokens=-5), "kv_cache_tokens must be a positive integer")):
        with pytest.raises(ValueError, match=said):
            load_engine(target, device="cpu", **kw)
    for cfg, said in (('{"method": "dflash", "model": 5}', "'model'"),
                      ('{"method": "dflash", "model": "d", "num_speculative_tokens": true}', "num_speculative_tokens")):
        with pytest.raises(ValueError, match=said):
            parse_speculative_config(cfg)

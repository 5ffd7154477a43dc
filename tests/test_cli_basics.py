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

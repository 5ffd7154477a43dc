"""engine/l2_stage.py: the stage map's parsing, that it does nothing off a GPU, and what its kernel asks of the L2.

No GPU runs here, so a child process compiles the prefetch kernel for sm_90 (triton's own ptxas; no device needed)
and reads its PTX: one bulk L2 prefetch a row, with an evict-last policy only when asked, and no load or store
(a prefetch brings nothing to the SM, so it can change no value).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashpd.engine import l2_stage

def test_a_spec_parses_to_bytes_a_row_by_role():
    assert l2_stage.parse("gate_up:1024, o_proj:1536") == {"gate_up": 1024, "o_proj": 1536}
    assert l2_stage.parse("") == {}


@pytest.mark.parametrize("bad", ["qkv:1024", "gate_up", "gate_up:0", "gate_up:1000", "gate_up:-16",
                                 "gate_up:16,gate_up:32", "gate_up:1e3"])
def test_a_bad_spec_is_refused(bad):
    with pytest.raises(ValueError, match="l2 stage"):
        l2_stage.parse(bad)


def test_off_a_gpu_nothing_is_staged(monkeypatch):
    monkeypatch.setattr(l2_stage, "STAGE", {"gate_up": 1024})
    x = torch.zeros(1, 8)
    assert not l2_stage.active(x)
    l2_stage.stage(x, {"gate_up": torch.zeros(4, 8)})
    l2_stage.join(x)
    assert l2_stage._state() == ({}, set())


CHILD = r'''
import json, sys
import torch
torch.backends.cuda.is_built = lambda: True  # a CPU build of torch: import triton as a CUDA build would
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashpd.engine import l2_stage
out = {}
for last in (False, True):
    sig = {"w_ptr": "*bf16", "rows": "i32", "row_bytes": "i32", "chunk": "i32", "BLOCK": "constexpr",
           "LAST": "constexpr"}
    cc = triton.compile(ASTSource(fn=l2_stage._stage_kernel, signature=sig, constexprs={"BLOCK": 128, "LAST": last}),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    lines = cc.asm["ptx"].splitlines()
    out[str(last)] = {"prefetch": sum("cp.async.bulk.prefetch.L2.global" in l for l in lines),
                      "evict_last": sum("evict_last" in l for l in lines),
                      "mem": sum(any(k in l for k in ("ld.global", "st.global")) for l in lines)}
print(json.dumps(out))
'''


def test_the_kernel_prefetches_each_row_and_touches_nothing():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # 128 rows over 4 warps: one row a thread, one prefetch instruction in the text
    assert out["False"] == {"prefetch": 1, "evict_last": 0, "mem": 0}
    assert out["True"]["prefetch"] == 1 and out["True"]["evict_last"] >= 1 and out["True"]["mem"] == 0

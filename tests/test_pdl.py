"""Programmatic dependent launch (triton_env.PDL_ENABLED): the switch, and where each kernel waits.

PDL keeps every bit only if no program touches memory another kernel writes before griddepcontrol.wait returns.
No GPU runs here, so a child process compiles each engine kernel with PDL for sm_90 (triton's own ptxas; no device
needed) and reads the order in its PTX: the wait before the first global load, store or async copy; the few-row
GEMM lets the next kernel launch after its last MMA and before its first store; a latency-bound kernel lets it
right after its wait (PDL 1), before it (PDL 2) or never (PDL 3). Plain launches (PDL 0) carry no griddepcontrol at all.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashpd.engine import triton_env

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import inspect, json, sys
import torch
torch.backends.cuda.is_built = lambda: True  # a CPU build of torch: import triton as a CUDA build would
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashpd.engine import paged_attention as pa, qkv_rope as qr, skinny_gemm as sg

FP32 = {"ss_ptr", "sso_ptr", "m_ptr", "l_ptr", "acc_ptr", "cos_ptr", "sin_ptr", "qk_scale", "eps"}
I64 = {"bt_ptr", "pos_ptr", "slot_ptr"}
MEM = ("ld.global", "st.global", "cp.async", "atom.global", "red.global")

def compile_(kernel, const, warps=4, stages=3):
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for p in params:
        if p in const:
            sig[p] = "constexpr"
        elif p.endswith("_ptr"):
            sig[p] = "*fp32" if p in FP32 else "*i64" if p in I64 else "*bf16"
        else:
            sig[p] = "fp32" if p in FP32 else "i32"
    if const.get("WQ"):  # an fp8 weight (skinny_gemm.Fp8Weight) and its fp32 row scales
        sig["w_ptr"], sig["s_ptr"] = "*fp8e4nv", "*fp32"
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in sig
             if p.endswith("_ptr") or p.startswith("s") and sig[p] == "i32" or p in ("N", "K")}
    cc = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages, "launch_pdl": const["PDL"] > 0})
    lines = cc.asm["ptx"].splitlines()
    at = lambda *keys: [i for i, l in enumerate(lines) if any(k in l for k in keys)]
    return {"wait": at("griddepcontrol.wait"), "release": at("griddepcontrol.launch_dependents"),
            "mem": at(*MEM), "mma": at("mma"), "store": at("st.global"), "bar": at("bar.sync"),
            "cp": at("cp.async.ca.shared.global", "cp.async.cg.shared.global"),
            "nc": [i for i in at("ld.global") if ".nc" in lines[i]]}

skinny = dict(BM=16, BN=16, BK=128, EVEN_K=True, F32=False, ROWWISE=False, P_PAD=16, WQ=0)
attn = dict(G=4, PAGE=16, D=128, D_PAD=128, BM=16, BN=32, KPC=256, F32=False, INTERPRET=False, ROPE=False, NQ=0,
            T_PAD=1, DT=tl.bfloat16)
rope = dict(attn, ROPE=True, NQ=32)
qkv_rope = dict(NQ=32, NKV=8, G=4, D=128, DT=tl.bfloat16, FIXED=False)
cases = {
    "skinny_rms_swiglu": (sg._skinny_kernel, dict(skinny, RMS=True, SWIGLU=True, RESID=False, NEXT=False, PDL=1)),
    "skinny_resid_next": (sg._skinny_kernel, dict(skinny, RMS=False, SWIGLU=False, RESID=True, NEXT=True, PDL=2)),
    "skinny_plain_off": (sg._skinny_kernel, dict(skinny, RMS=False, SWIGLU=False, RESID=False, NEXT=False, PDL=0)),
    "skinny_fp8_rms_swiglu": (sg._skinny_kernel, dict(skinny, WQ=2, RMS=True, SWIGLU=True, RESID=False,
                                                      NEXT=False, PDL=1)),
    "skinny_fp8_resid_next": (sg._skinny_kernel, dict(skinny, WQ=2, RMS=False, SWIGLU=False, RESID=True,
                                                      NEXT=True, PDL=2)),
    "prep_first": (sg._prep_kernel, dict(BK=1024, PDL=2)),
    "qkv_rope_after": (qr._qkv_rope_kernel, dict(qkv_rope, PDL=1)),
    "qkv_rope_fixed_after": (qr._qkv_rope_kernel, dict(qkv_rope, FIXED=True, PDL=1)),
    "attn_rope_split_after": (pa._attn_kernel, dict(rope, SPLIT=True, PDL=1)),
    "attn_rope_verify_never": (pa._attn_kernel, dict(rope, SPLIT=True, T_PAD=16, PDL=3)),
    "attn_split_first": (pa._attn_kernel, dict(attn, SPLIT=True, PDL=2)),
    "attn_walk_after": (pa._attn_kernel, dict(attn, SPLIT=False, PDL=1)),
    "attn_split_after": (pa._attn_kernel, dict(attn, SPLIT=True, PDL=1)),
    "combine_first": (pa._combine_kernel, dict(G=4, D=128, D_PAD=128, BM=4, DC=32, KPC=256, UNROLL=1, PDL=2)),
    "combine_never": (pa._combine_kernel, dict(G=4, D=128, D_PAD=128, BM=16, DC=32, KPC=256, UNROLL=8, PDL=3)),
    "skinny_never": (sg._skinny_kernel, dict(skinny, RMS=False, SWIGLU=False, RESID=True, NEXT=False, PDL=3)),
    "prep_never": (sg._prep_kernel, dict(BK=1024, PDL=3)),
    "qkv_rope_never": (qr._qkv_rope_kernel, dict(qkv_rope, PDL=3)),
    "attn_split_never": (pa._attn_kernel, dict(attn, SPLIT=True, PDL=3)),
    "attn_walk_never": (pa._attn_kernel, dict(attn, SPLIT=False, PDL=3)),
}
out = {}
for name in sys.argv[1:]:
    kernel, const = cases[name]
    out[name] = compile_(kernel, const, **({"warps": 2, "stages": 4} if kernel is sg._skinny_kernel else {}))
print(json.dumps(out))
'''

# any PDL: release after the loop (the fp8 forms too: sm_90 PTX compiled here, with their e4m3 weight loads)
GEMMS = ("skinny_rms_swiglu", "skinny_resid_next", "skinny_never", "skinny_fp8_rms_swiglu", "skinny_fp8_resid_next")
# the engine's default form (PDL_LATENCY_RELEASE 0 -> PDL 3) for every latency kernel, and the other two forms (a
# one-row decode's qkv_rope and split attention take 1: PDL_RELEASE_TO_LATENCY)
LATENCY = {"prep_first": 2, "qkv_rope_after": 1, "attn_split_first": 2, "attn_walk_after": 1, "attn_split_after": 1,
           "combine_first": 2, "qkv_rope_fixed_after": 1, "attn_rope_split_after": 1, "attn_rope_verify_never": 3,
           "combine_never": 3, "prep_never": 3, "qkv_rope_never": 3, "attn_split_never": 3, "attn_walk_never": 3}


def compiled() -> dict:
    """Each case's PTX line numbers (see CHILD), from one child process; skips if triton cannot compile here."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    names = [*GEMMS, "skinny_plain_off", *LATENCY]
    proc = subprocess.run([sys.executable, "-c", CHILD, *names], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ptx() -> dict:
    return compiled()


def test_pdl_is_on_by_default_with_latency_kernels_never_releasing_and_off_the_gpu() -> None:
    assert triton_env.PDL_ENABLED is True and triton_env.PDL_LATENCY_RELEASE == 0
    # on, a CPU tensor's launch still has none (and the interpreter none at all)
    assert triton_env.pdl_args(torch.device("cpu")) == {"PDL": 0}


@pytest.mark.parametrize("name", GEMMS)
def test_the_gemm_waits_before_memory_and_releases_after_its_last_mma(ptx: dict, name: str) -> None:
    c = ptx[name]
    assert len(c["wait"]) == 1 and len(c["release"]) == 1, c
    assert c["mem"] and c["wait"][0] < min(c["mem"])
    assert c["mma"] and max(c["mma"]) < c["release"][0] < min(c["store"])


@pytest.mark.parametrize("name", sorted(LATENCY))
def test_a_latency_kernel_waits_before_memory_and_releases_at_its_top(ptx: dict, name: str) -> None:
    c = ptx[name]
    if LATENCY[name] == 3:  # waits, never lets the next kernel launch early
        assert len(c["wait"]) == 1 and c["release"] == [] and c["wait"][0] < min(c["mem"]), c
        return
    assert len(c["wait"]) == 1 and len(c["release"]) == 1, c
    assert c["mem"] and c["wait"][0] < min(c["mem"]) and c["release"][0] < min(c["mem"])
    if LATENCY[name] == 2:
        assert c["release"][0] < c["wait"][0]
    else:
        assert c["wait"][0] < c["release"][0]


def test_plain_launches_carry_no_griddepcontrol(ptx: dict) -> None:
    c = ptx["skinny_plain_off"]
    assert c["wait"] == [] and c["release"] == [] and c["mem"]


def test_the_latency_release_setting_picks_each_kernels_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_env, "pdl", lambda device: True)  # no sm_90 device here: its check stands in
    for release, code in ((1, 1), (2, 2), (0, 3)):
        monkeypatch.setattr(triton_env, "PDL_LATENCY_RELEASE", release)
        assert triton_env.pdl_args(torch.device("cuda")) == {"PDL": code, "launch_pdl": True}
    monkeypatch.setattr(triton_env, "PDL_LATENCY_RELEASE", 3)
    with pytest.raises(ValueError, match="PDL_LATENCY_RELEASE"):
        triton_env.pdl_args(torch.device("cuda"))


def test_a_one_token_call_of_few_rows_lets_its_latency_successor_launch_early(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    """PDL_RELEASE_TO_LATENCY applies to a latency kernel followed by a latency kernel in a one-token call of at most
    PDL_RELEASE_MAX_ROWS rows (a decode at batch 1); verify and draft calls, bigger batches and kernels followed by
    a GEMM keep PDL_LATENCY_RELEASE (0: never, constexpr 3)."""
    monkeypatch.setattr(triton_env, "pdl", lambda device: True)
    dev = torch.device("cuda")
    code = {0: 3, 1: 1, 2: 2}
    early = code[triton_env.PDL_RELEASE_TO_LATENCY]
    late = code[triton_env.PDL_LATENCY_RELEASE]
    assert triton_env.PDL_RELEASE_TO_LATENCY == 1 and triton_env.PDL_LATENCY_RELEASE == 0
    assert triton_env.pdl_args(dev, True, tokens=1, rows=1) == {"PDL": early, "launch_pdl": True}
    assert triton_env.pdl_args(dev, True, tokens=1, rows=triton_env.PDL_RELEASE_MAX_ROWS)["PDL"] == early
    assert triton_env.pdl_args(dev, True, tokens=1, rows=triton_env.PDL_RELEASE_MAX_ROWS + 1)["PDL"] == late
    assert triton_env.pdl_args(dev, True, tokens=16, rows=16)["PDL"] == late
    assert triton_env.pdl_args(dev, True, tokens=16, rows=1)["PDL"] == late
    assert triton_env.pdl_args(dev, False, tokens=1, rows=1)["PDL"] == late
    assert triton_env.pdl_args(dev)["PDL"] == late
    monkeypatch.setattr(triton_env, "PDL_RELEASE_TO_LATENCY", 5)
    with pytest.raises(ValueError, match="PDL_RELEASE_TO_LATENCY"):
        triton_env.pdl_args(dev, True, tokens=1, rows=1)


@pytest.mark.parametrize("name", ["attn_rope_split_after", "attn_rope_verify_never"])
def test_the_rope_form_writes_its_keys_then_barriers_before_it_reads_the_cache(ptx: dict, name: str) -> None:
    """qkv_rope's work inside the paged kernel (qkv_rope.IN_ATTENTION): a program writes the K/V it will read, so
    in its PTX every cache store comes before a bar.sync, which comes before the first cache load (cp.async), and
    no global load takes the non-coherent path (.nc), which need not see this kernel's own writes."""
    c = ptx[name]
    first_read = min(c["cp"])
    writes = [i for i in c["store"] if i < first_read]
    assert writes, c  # the key/value writes (the output's stores come after every read)
    assert any(max(writes) < b < first_read for b in c["bar"]), c
    assert c["nc"] == []

"""RunnerConfig (engine/runner_config.py): validation, resolution for a device, and how a ModelRunner holds and
hands on its knobs (issue 21: knobs in a config, not patched globals)."""
from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest
import torch

from flashpd.engine.config import Qwen3Config
from flashpd.engine.kv_cache import BlockTable
from flashpd.engine.loader import dummy_target
from flashpd.engine.qwen3 import EAGER
from flashpd.engine.runner import ModelRunner, RunnerConfig, inductor_options


@pytest.mark.parametrize("bad", [dict(attention_impl="flash"), dict(prefill_graph_tokens=0),
                                 dict(prefill_graph_tokens=True), dict(prefill_chunk=-1), dict(prefill_chunk="big"),
                                 dict(compile_backend=""), dict(cuda_graphs="yes"), dict(fresh_prefill=None),
                                 dict(compile_deterministic="yes"),
                                 dict(compile_eager_rounding="yes"), dict(inductor_extra=[("combo_kernels", True)]),
                                 dict(inductor_extra=(("no_such_entry", 1),)),
                                 dict(inductor_extra=(("deterministic", False),)), dict(blas="cutlass"),
                                 dict(blas="")])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        RunnerConfig(**bad)


def test_the_forced_paged_form_needs_triton():
    """attention_impl "paged" is refused where the kernel cannot run (this CPU without triton's interpreter),
    never silently replaced by the gathered form."""
    from flashpd.engine import paged_attention
    if paged_attention.available():  # pragma: no cover (a GPU, or the interpreter)
        assert RunnerConfig(attention_impl="paged").attention_impl == "paged"
    else:
        with pytest.raises(ValueError, match="triton"):
            RunnerConfig(attention_impl="paged")


def test_resolution_follows_the_device():
    cpu, gpu = RunnerConfig().resolved("cpu"), RunnerConfig().resolved("cuda")
    assert (cpu.cuda_graphs, cpu.compile, cpu.prefill_chunk) == (False, False, None)
    assert (gpu.cuda_graphs, gpu.compile, gpu.prefill_chunk) == (True, True, 1024)
    c = RunnerConfig(cuda_graphs=True, compile=False, prefill_graph_tokens=256).resolved("cpu")
    assert (c.cuda_graphs, c.compile, c.prefill_chunk) == (True, False, 256)
    assert RunnerConfig(cuda_graphs=True, prefill_chunk=None).resolved("cpu").prefill_chunk is None


def test_inductor_options_follow_the_config():
    """Inductor's reduction configs are fixed, not timed at first launch (RunnerConfig.compile_deterministic,
    default on); it rounds intermediates as eager does only when asked (compile_eager_rounding, default off).
    Combo kernels are on unless inductor_extra turns them off.
    The options must be ones this torch's inductor knows (torch.compile refuses unknown ones)."""
    import torch._inductor.config as inductor_config

    assert inductor_options(RunnerConfig()) == {"deterministic": True, "emulate_precision_casts": False,
                                                "combo_kernels": True}
    assert inductor_options(RunnerConfig(compile_deterministic=False, compile_eager_rounding=True)) == {
        "deterministic": False, "emulate_precision_casts": True, "combo_kernels": True}
    assert all(hasattr(inductor_config, k) for k in inductor_options(RunnerConfig()))
    extra = inductor_options(RunnerConfig(inductor_extra=(("combo_kernels", False),)))
    assert extra == {"deterministic": True, "emulate_precision_casts": False, "combo_kernels": False}


def _model():
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return dummy_target(cfg, "cpu", torch.float32)


def test_runner_holds_the_resolved_config_and_reconfigures_only_prefill_knobs():
    r = ModelRunner(_model(), 8, 16, config=RunnerConfig(cuda_graphs=True, compile=False))
    c = r.config
    assert (c.prefill_chunk, c.cuda_graphs, c.compile) == (1024, True, False)
    with pytest.raises(FrozenInstanceError):
        setattr(r.config, "prefill_chunk", 64)
    old = r.reconfigure(prefill_chunk=64, fresh_prefill=False)
    assert (old.prefill_chunk, r.config.prefill_chunk, r.config.fresh_prefill) == (1024, 64, False)
    with pytest.raises(ValueError, match="cuda_graphs"):
        r.reconfigure(cuda_graphs=False)


def test_blas_choice_is_made_only_for_a_gpu_runner():
    """RunnerConfig.blas (default cuBLASLt) is torch's per-process BLAS preference, so only a runner on a CUDA
    device sets it: building one on the CPU leaves the process's choice as it was, whatever the config says."""
    assert RunnerConfig().blas == "cublaslt" and RunnerConfig(blas=None).blas is None
    before = torch.backends.cuda.preferred_blas_library()
    ModelRunner(_model(), 8, 16, config=RunnerConfig(cuda_graphs=False, blas="cublaslt"))
    assert torch.backends.cuda.preferred_blas_library() == before


def test_forced_attention_reaches_the_forward_metadata(monkeypatch):
    import flashpd.engine.qwen3 as qwen3  # noqa: PLC0415

    seen = []
    real = qwen3.grouped_attention
    monkeypatch.setattr(qwen3, "grouped_attention", lambda *a: seen.append(a[-1]) or real(*a))
    for impl in (None, "matmul", "sdpa"):
        r = ModelRunner(_model(), 8, 16, config=RunnerConfig(cuda_graphs=False, attention_impl=impl))
        t = BlockTable()
        r.allocator.ensure(t, 4)
        r.forward([t], [[1, 2, 3]])  # a fresh prefill (causal kernel), then a decode step over the cache
        r.allocator.ensure(t, 5)
        r.forward([t], [[4]])
        assert seen[-1] == impl


def test_the_step_functions_run_one_code_for_every_size_whatever_came_first():
    """ModelRunner compiles every step function with symbolic sizes from the first call: rows of 3, 5
    and 3 tokens through its compiled final norm run one compiled graph. Under dynamo's default, 3 would compile
    static, 5 symbolic, and a CUDA graph captured for 3 before 5 was seen would keep other code than one
    captured after (in bf16 on a GPU, DFlash and native then parted on a long prompt: docs/results.md)."""
    import torch._dynamo  # noqa: PLC0415

    torch._dynamo.reset()
    model = _model()
    r = ModelRunner(model, 8, 16, config=RunnerConfig(cuda_graphs=False, compile=True, compile_backend="aot_eager"))
    w, eps = model.norm.weight, model.cfg.rms_norm_eps
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for n in (3, 5, 3):
        x = torch.randn(2, n, 32)
        assert torch.equal(r.graph_fns.norm(x, w, eps), EAGER.norm(x, w, eps))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    torch._dynamo.reset()

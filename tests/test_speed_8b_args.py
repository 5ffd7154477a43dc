"""bench/speed_8b.py's --inductor-option values become typed RunnerConfig.inductor_extra entries, and a malformed
one is refused with the form it needs (the bench itself needs a GPU; its argument parsing does not)."""
from __future__ import annotations

import pytest

from flashpd.bench.speed_8b import inductor_option
from flashpd.engine.runner_config import RunnerConfig


def test_inductor_options_parse_to_typed_entries_the_config_takes():
    extra = tuple(inductor_option(s) for s in ("combo_kernels=true", "emulate_precision_casts_x=0", "a=0.5"))
    assert extra == (("combo_kernels", True), ("emulate_precision_casts_x", 0), ("a", 0.5))
    assert RunnerConfig(inductor_extra=extra[:1]).inductor_extra == (("combo_kernels", True),)
    with pytest.raises(ValueError, match="no config entry"):
        RunnerConfig(inductor_extra=extra)


@pytest.mark.parametrize("bad", ["combo_kernels", "=1"])
def test_a_malformed_option_is_refused(bad):
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        inductor_option(bad)


def test_the_recorded_command_is_the_typed_one():
    """A results JSON's `command` pastes back: flags as typed (a store_true flag without a value, a repeated
    option repeated), an argument with a space quoted."""
    from flashpd.bench.common import command_line
    argv = ["--eager-rounding", "--inductor-option", "combo_kernels=true", "--inductor-option", "a=1",
            "--out", "my dir/x.json"]
    assert command_line("flashpd.bench.speed_8b", argv) == (
        "python -m flashpd.bench.speed_8b --eager-rounding --inductor-option combo_kernels=true "
        "--inductor-option a=1 --out 'my dir/x.json'")


def test_draft_vocabulary_rows_are_reported_apart_from_the_issue_figure():
    """The reduced-vocabulary steps get their own labelled ratio over the native step of the same batch; the
    issue's dflash_over_native_step stays the whole head's."""
    from flashpd.bench.speed_8b import fields
    res = {"native_curve": [{"batch": 1, "ms_per_step": 4.0, "floor_ms": 3.0, "floor_ms_bytes_read": 3.0},
                            {"batch": 32, "ms_per_step": 5.0, "floor_ms": 4.0, "floor_ms_bytes_read": 4.0,
                             "floor_fraction": 0.8}],
           "dflash_b1": {"ms_per_step": 5.0},
           "dflash_draft_vocab": [{"draft_vocab": 32768, "batch": 1, "ms_per_step": 4.6},
                                  {"draft_vocab": 0, "batch": 32, "ms_per_step": 10.0},
                                  {"draft_vocab": 32768, "batch": 64, "ms_per_step": 9.0}]}
    out = fields(res)
    assert out["dflash_over_native_step"] == pytest.approx(1.25)
    assert out["dflash_over_native_step_b1_draft_vocab_32768"] == pytest.approx(1.15)
    assert out["dflash_over_native_step_b32_draft_vocab_full"] == pytest.approx(2.0)
    assert not any("b64" in k for k in out), "no native step at batch 64 to divide by"


def test_long_context_rows_get_their_own_labelled_ratio():
    """The `long` section's rows give dflash_over_native_step_b1_ctx{N} from their own native step; the issue's
    dflash_over_native_step stays the one at --context."""
    from flashpd.bench.speed_8b import fields
    res = {"native_curve": [{"batch": 1, "ms_per_step": 4.0, "floor_ms": 3.0, "floor_ms_bytes_read": 3.0}],
           "dflash_b1": {"ms_per_step": 5.0},
           "by_context": [{"context": 4096, "native": {"ms_per_step": 5.0}, "dflash": {"ms_per_step": 8.0}}]}
    out = fields(res)
    assert out["dflash_over_native_step"] == pytest.approx(1.25)
    assert out["dflash_over_native_step_b1_ctx4096"] == pytest.approx(1.6)

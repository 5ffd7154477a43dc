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

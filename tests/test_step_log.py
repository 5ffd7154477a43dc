"""The decode worker's periodic engine log (decode_node/step_log.py): a line per interval with the steps, their
mean time, the tokens streamed, the requests admitted and the device-loop sessions ended since the last line,
read from a real worker serving real requests on the CPU."""
from __future__ import annotations

import logging
import re

from flashpd.decode_node.worker import DecodeWorker
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)
from tests.test_decode_worker import _drain

LINE = re.compile(r"engine: (\d+) steps in [\d.]+ s \([\d.]+ ms a step, stepping [\d.]+ s\), (\d+) tokens \(\d+/s\), "
                  r"(\d+) admitted, (\d+) device-loop sessions ended, running (\d+), waiting (\d+)")
TIMES = re.compile(r"steps in ([\d.]+) s \(([\d.]+) ms a step, stepping ([\d.]+) s\)")


def test_the_log_accounts_for_every_step_token_and_admission(dflash_pair, caplog):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    w = DecodeWorker(ModelRunner(target, 64, 16), step_log_s=1e-9)  # a line after every step
    try:
        with caplog.at_level(logging.INFO, logger="flashpd.decode_node.step_log"):
            toks = [_drain(w.submit([3 + i, 4, 5, 6], SamplingParams(max_tokens=6, ignore_eos=True)))[0]
                    for i in range(2)]
            steps = w.loop.steps
    finally:
        w.stop()
    rows = [tuple(int(g) for g in m.groups()) for m in map(LINE.search, caplog.messages) if m]
    assert rows, caplog.messages
    assert sum(r[0] for r in rows) == steps  # each step in exactly one line
    assert sum(r[1] for r in rows) == sum(len(t) for t in toks) == 12
    assert sum(r[2] for r in rows) == 2  # both requests admitted
    assert rows[-1][4:] == (0, 0)  # the last line: nothing running, nothing waiting


def test_no_log_when_turned_off_or_idle(dflash_pair, caplog):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    w = DecodeWorker(ModelRunner(target, 64, 16), step_log_s=0)
    try:
        assert w.step_log is None
        with caplog.at_level(logging.INFO, logger="flashpd.decode_node.step_log"):
            _drain(w.submit([3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True)))
    finally:
        w.stop()
    assert not [m for m in caplog.messages if LINE.search(m)]
    idle = DecodeWorker(ModelRunner(target, 64, 16), step_log_s=1e-9)
    try:
        with caplog.at_level(logging.INFO, logger="flashpd.decode_node.step_log"):
            idle.step_log()  # no step since the last reading: no line
    finally:
        idle.stop()
    assert not [m for m in caplog.messages if LINE.search(m)]


def test_time_a_step_leaves_out_the_idle_time_between_requests(dflash_pair, caplog):  # noqa: F811
    """The line divided its interval by its steps: an H100 serving a few requests with pauses between logged
    246 ms a step for steps of about a millisecond."""
    import time

    target = load_target(dflash_pair.target_dir)
    w = DecodeWorker(ModelRunner(target, 64, 16), step_log_s=1.0)
    try:
        with caplog.at_level(logging.INFO, logger="flashpd.decode_node.step_log"):
            _drain(w.submit([3, 4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True)))
            time.sleep(1.5)  # idle: the next line's interval holds this pause
            _drain(w.submit([4, 4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True)))
    finally:
        w.stop()
    times = [tuple(float(g) for g in m.groups()) for m in map(TIMES.search, caplog.messages) if m]
    assert times and max(t for t, _, _ in times) >= 1.0, caplog.messages
    for (interval, ms, busy), row in zip(times, (LINE.search(m) for m in caplog.messages if TIMES.search(m))):
        steps = int(row.group(1))
        assert busy <= interval and ms * steps / 1e3 <= busy + 0.05
        assert ms < interval * 1e3 / steps / 2  # a CPU step of this tiny model is far below the pause

"""Progress of the long training stages (regeneration, target features, training steps, evaluation).

A bar goes to stderr and only when stderr is a terminal (tqdm's disable=None): a log file or a pipe gets
no carriage-return redraws, only the stages' log lines (`log_line`), which say how far a run got.
`log_line` prints to stdout around any bar on the terminal, so the two never share a line.
"""
from __future__ import annotations

import sys
from typing import Iterable

from tqdm import tqdm


def bar(iterable: Iterable | None = None, *, desc: str, total: int | None = None, unit: str = "it",
        initial: int = 0) -> tqdm:
    """A progress bar on stderr, shown on a terminal only, redrawn at most once a second."""
    return tqdm(iterable, desc=desc, total=total, unit=unit, initial=initial, file=sys.stderr, disable=None,
                mininterval=1.0, dynamic_ncols=True)


def log_line(msg: str) -> None:
    """`print(msg)`, but clear of the progress bars on the terminal."""
    tqdm.write(msg, file=sys.stdout)

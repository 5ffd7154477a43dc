"""How wide a DFlash step verifies: a fixed width, or a cut where the drafter's own confidence falls.

Why a policy: a verify pass costs the target rows x T positions (rows are padded to the batch's widest,
T). At batch 1 a wide block is nearly free (the pass is bound by weights, not positions), so wider
amortizes better; under load every drafted-and-rejected position is verify compute spent for nothing.

`FixedWidth` is what a step always did: the request's draft width (or a fixed cap on it). `ConfidenceWidth`
picks the width per step and row from the draft's confidence: c_k, the drafter's probability of its own
greedy token at block position k (a softmax at temperature 1 over the draft logits the step already
computes, for greedy and sampled rows alike). A row
keeps its guesses up to the first position with c_k < threshold, at least `min_width` and, informed by
recent acceptance, at least the mean of its last `window` acceptance lengths (a drafter that is right
while unsure is not cut below what it has been delivering). A batch-level rule then trades width
against batch size: the batch verifies at T = the widest row's choice, capped by `max_width_by_batch`;
with `share_batch_width` every row verifies at T (the padded positions are computed anyway), else at
its own choice. T rounds up to a multiple of `verify_multiple`, so that a GPU captures a few verify
graphs rather than one per width (a capture inside a timed run is noise, and memory).

Exactness, any width: greedy acceptance takes the longest prefix of the (shorter) draft that equals
the target's argmax and appends the target's own token, so every committed token is the target's
choice whatever the width in [1, block]. Sampled rows: the width is fixed before any guess of the step
is drawn, from the draft distributions (a DFlash draft computes every position's q in one pass from the
committed prefix alone) and from past steps; speculative rejection sampling over a block whose width
does not depend on its own draws keeps the target's distribution. A rule that looked at a drawn guess
(e.g. its own q(x)) to decide whether to verify it would bias it; none here does.

Cost, stated: the cut needs the confidences on the host before the verify launches, so a cutting step
runs draft and verify as two passes with a host round trip between (spec_decode's `_cut_step`), never
as the device step (engine/device_loop.py), which replays one captured graph per batch shape. `cut_from_batch`
is therefore the batch size from which the cut runs; below it the policy is a width by batch size, which the
device step runs as any fixed width. The policy's own cost, `WidthStats.policy_ms`: host time from the draft's
guesses reaching the host (that readback waits for the draft pass, which is not counted) to the widths chosen:
the confidences' softmax, their copy back and the rule. The route's cost beside the one-graph step is what
bench/adaptive.py's route control (the cut path at threshold 0: the fixed block's tokens, two passes)
measures.

No speculation past a batch size (`BatchWidth`, or a cap of 1 in any policy's caps): under load a verify
pass is bound by compute, not weights, and every rejected position is spent for nothing; SGLang and vLLM
turn speculation off past a batch size for that reason. A cap of 1 at a batch size means "no draft": the
serving scheduler (decode_node/scheduler.py, `step_undrafted`) then steps those DFlash rows as native steps
(one target position each, the target's own token, so greedy output is native's and sampled rows sample the
target) whose forward also writes the drafter's context for the new position (its taps, through the same
sink a prefill uses), so that drafting resumes, exact and with a complete draft context, as soon as the
batch shrinks under the size. Its cost beside a native step: the drafter's context write of one position per
row (fc, norm and the K/V projections of each draft layer: at the Qwen3-8B / DFlash-b16 shape about 1.5% of
the target's weights), and, on a step that follows a drafted one, an eager write of the accepted positions'
pending context; those rows step stepwise, not in the device loop (whose DFlash step always drafts).
Anywhere else (DFlashGenerator on its own, the device loop) a width of 1 still runs the draft pass of a
1-wide block: exact, but it costs a drafter forward for no guess.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence as Seq

MAX_BLOCK = 16  # flashpd's widest DFlash block


@dataclass
class WidthStats:
    """What a generator's width policy did over its `spec_step` calls (a session's steps are not
    counted). policy_ms: host time of confidence readback plus width choice, in the cutting steps only."""

    steps: int = 0  # stepwise DFlash steps
    cut_steps: int = 0  # of them through the confidence cut
    rows: int = 0  # row-steps in the cutting steps
    policy_ms: float = 0.0
    verified: int = 0  # target positions the cutting steps' verify passes computed (rows x padded width)
    widths: dict[int, int] = field(default_factory=dict)  # batch width T -> cutting steps at it

    def as_dict(self) -> dict:
        d = asdict(self)
        d["policy_ms_per_step"] = self.policy_ms / self.cut_steps if self.cut_steps else None
        d["verified_per_row_step"] = self.verified / self.rows if self.rows else None
        return d


class WidthPolicy:
    """Base: the batch's width cap by batch size, whether this batch's step cuts by confidence, and the cut."""

    def cap(self, batch: int) -> int:
        """The widest block a step of `batch` rows may verify (each row is also held to its own draft width)."""
        return MAX_BLOCK

    def cuts(self, batch: int) -> bool:
        """Whether a step of `batch` rows chooses widths from the draft's confidence (a host round trip)."""
        return False

    def speculates(self, batch: int) -> bool:
        """Whether a step of `batch` DFlash rows drafts at all: a cap of 1 means no speculation at that size
        (the serving scheduler steps those rows natively, keeping their draft context: module doc)."""
        return self.cap(batch) >= 2

    def choose(self, recent: list[list[int]], limits: list[int], conf: list[list[float]]) -> list[int]:
        """Verify width of each row, 2 <= w <= limits[i]: recent acceptance lengths per row, the row's
        widest allowed width, and c_k per drafted position (at least limits[i] - 1 of them)."""
        return list(limits)

    def batch_width(self, widths: list[int], limits: list[int]) -> int:
        """The width T the step's verify pads every row to (at least the widest row's choice)."""
        return max(widths)

    def describe(self) -> dict:
        return {"policy": type(self).__name__, **asdict(self)}  # type: ignore[call-overload]


@dataclass(frozen=True)
class FixedWidth(WidthPolicy):
    """Every step verifies the row's whole block (its draft width), at most `width` (16, the default: no cap)."""

    width: int = MAX_BLOCK

    def __post_init__(self) -> None:
        if not 2 <= self.width <= MAX_BLOCK:
            raise ValueError(f"FixedWidth width must be in [2, {MAX_BLOCK}], got {self.width}")

    def cap(self, batch: int) -> int:
        return self.width


@dataclass(frozen=True)
class ConfidenceWidth(WidthPolicy):
    """Cut each row's block before the first drafted position whose confidence is below `threshold`
    (see the module doc for the rule, its exactness and its cost).

    max_width_by_batch: (batch size at least, max width) steps, ascending; the default holds a step to about
    128 verify positions (16 wide up to 8 rows, 8 up to 16, then 4). A guess to be set from
    bench/adaptive.py's screen on the GPU that serves."""

    threshold: float = 0.5
    min_width: int = 2
    window: int = 4
    max_width_by_batch: tuple[tuple[int, int], ...] = ((1, 16), (9, 8), (17, 4))
    cut_from_batch: int = 2
    share_batch_width: bool = True
    verify_multiple: int = 4  # T rounds up to a multiple of this: a few captured verify shapes, not 15

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if not 2 <= self.min_width <= MAX_BLOCK:
            raise ValueError(f"min_width must be in [2, {MAX_BLOCK}], got {self.min_width}")
        if self.window < 0 or self.cut_from_batch < 1 or not 1 <= self.verify_multiple <= MAX_BLOCK:
            raise ValueError(f"window must be >= 0, cut_from_batch >= 1 and verify_multiple in [1, {MAX_BLOCK}], got "
                             f"{self.window}, {self.cut_from_batch}, {self.verify_multiple}")
        steps = tuple((int(b), int(w)) for b, w in self.max_width_by_batch)
        object.__setattr__(self, "max_width_by_batch", steps)
        _check_caps(steps)

    def cap(self, batch: int) -> int:
        return _cap(self.max_width_by_batch, batch)

    def cuts(self, batch: int) -> bool:
        return batch >= self.cut_from_batch and self.speculates(batch)

    def choose(self, recent: list[list[int]], limits: list[int], conf: list[list[float]]) -> list[int]:
        want = []
        for hist, lim, c in zip(recent, limits, conf):
            k = 0
            while k < lim - 1 and c[k] >= self.threshold:
                k += 1
            w = k + 1  # the confident guesses, then the verify's own token
            h = hist[-self.window:] if self.window else []
            if h:
                w = max(w, math.ceil(sum(h) / len(h)))
            want.append(min(max(w, self.min_width), lim))
        if not self.share_batch_width:
            return want
        t = self.batch_width(want, limits)
        return [min(t, lim) for lim in limits]

    def batch_width(self, widths: list[int], limits: list[int]) -> int:
        m = self.verify_multiple
        return min(-(-max(widths) // m) * m, max(limits))


@dataclass(frozen=True)
class BatchWidth(WidthPolicy):
    """A width by batch size and nothing else (no confidence cut, so the device step runs it as a fixed width): `max_width_by_batch` as ConfidenceWidth's, (batch size at least, max width)
    ascending from batch 1. A width of 1 turns speculation off from that size on: "1-16/65-1" drafts 16 wide
    below 65 DFlash rows in a step and not at all from 65 (module doc: what a row costs then, and why it stays
    exact). The batch size is the step's DFlash rows (native rows beside them are not counted)."""

    max_width_by_batch: tuple[tuple[int, int], ...] = ((1, MAX_BLOCK),)

    def __post_init__(self) -> None:
        steps = tuple((int(b), int(w)) for b, w in self.max_width_by_batch)
        object.__setattr__(self, "max_width_by_batch", steps)
        _check_caps(steps)

    def cap(self, batch: int) -> int:
        return _cap(self.max_width_by_batch, batch)


def _check_caps(steps: tuple[tuple[int, int], ...]) -> None:
    if not steps or steps[0][0] != 1 or any(b2 <= b1 for (b1, _), (b2, _) in zip(steps, steps[1:])):
        raise ValueError(f"max_width_by_batch must start at batch 1 and ascend, got {steps}")
    if any(not 1 <= w <= MAX_BLOCK for _, w in steps):
        raise ValueError(f"max_width_by_batch widths must be in [1, {MAX_BLOCK}] (1: no speculation), got {steps}")


def _cap(steps: tuple[tuple[int, int], ...], batch: int) -> int:
    return next(w for b, w in reversed(steps) if batch >= b)


def _caps(text: str) -> tuple[tuple[int, int], ...]:
    """caps= text ("1-16/9-8/65-1": from batch size b, at most width w) as max_width_by_batch."""
    try:
        steps = [tuple(int(x) for x in step.split("-")) for step in text.split("/")]
    except ValueError:
        steps = []
    if not steps or any(len(st) != 2 for st in steps):
        raise ValueError(f"caps must read like 1-16/9-8/65-1 (from batch size b, at most width w), got {text!r}")
    return tuple((b, w) for b, w in steps)


def parse_width_policy(spec: str) -> WidthPolicy:
    """A policy from text (command lines, configs): "fixed", "fixed:8", "batch:caps=1-16/65-1" (16 wide under
    65 DFlash rows a step, no speculation from 65), "confidence" or
    "confidence:threshold=0.4,cut_from_batch=1,caps=1-16/9-8/17-4,window=0,share=0,verify_multiple=1"."""
    name, _, args = spec.partition(":")
    if name in ("confidence", "batch"):
        pairs = [a for a in args.split(",") if a]
        if any("=" not in a for a in pairs):
            raise ValueError(f"{name} width options are k=v pairs, got {spec!r}")
        kv = dict(a.split("=", 1) for a in pairs)
    else:
        kv = {}
    if name == "fixed":
        return FixedWidth(int(args)) if args else FixedWidth()
    if name == "batch":
        if set(kv) - {"caps"}:
            raise ValueError(f"unknown batch width option(s) {sorted(set(kv) - {'caps'})} in {spec!r} (caps=...)")
        return BatchWidth(_caps(kv["caps"])) if "caps" in kv else BatchWidth()
    if name != "confidence":
        raise ValueError(f"width policy must be 'fixed[:W]', 'batch:caps=...' or 'confidence[:k=v,...]', got {spec!r}")
    known = {"threshold": float, "min_width": int, "window": int, "cut_from_batch": int, "verify_multiple": int}
    out: dict = {}
    for k, v in kv.items():
        if k in known:
            out[k] = known[k](v)
        elif k == "caps":
            out["max_width_by_batch"] = _caps(v)
        elif k == "share":
            out["share_batch_width"] = v not in ("0", "false", "False")
        else:
            raise ValueError(f"unknown confidence width option {k!r} in {spec!r}")
    return ConfidenceWidth(**out)


def caps_text(steps: Seq[tuple[int, int]]) -> str:
    """max_width_by_batch as parse_width_policy's caps= text."""
    return "/".join(f"{b}-{w}" for b, w in steps)

"""RequestStats' per-position acceptance, kept as two histograms a step, against its definition: per draft
position k, the steps that drafted it (width - 1 > k) and the steps that accepted it (accepted > k)."""
from __future__ import annotations

import random

from flashpd.engine.sequence import RequestStats


def _by_definition(steps: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    most = max((w - 1 for _, w, _ in steps), default=0)
    return ([sum(a > k for _, _, a in steps) for k in range(most)],
            [sum(w - 1 > k for _, w, _ in steps) for k in range(most)])


def test_position_counts_match_their_definition_for_mixed_widths():
    rng = random.Random(1)
    for _ in range(2000):
        steps = []
        for _ in range(rng.randint(0, 12)):
            w = rng.choice([1, 2, 3, 4, 8, 16])
            a = rng.randint(0, w - 1)
            steps.append((a + 1, w, a))
        st = RequestStats()
        for s in steps:
            st.record_step(*s)
        assert (st.position_accepts, st.position_drafted) == _by_definition(steps), steps
        assert st.acceptance_lengths == [k for k, _, _ in steps]
        d = st.as_dict()
        if steps:
            assert len(d["position_acceptance"]) == max(w for _, w, _ in steps) - 1


def test_a_rollback_leaves_the_counts_of_the_kept_steps_only():
    """The scheduler rolls a row back to what it streamed (a step fault, a cancel) and runs the dropped steps
    again: after the rollback every count (acceptance lengths and both histograms) is that of the kept steps,
    so a redone step counts once; a dropped widest step takes its positions with it (no 0 / 0)."""
    rng = random.Random(2)
    for _ in range(2000):
        steps = []
        for _ in range(rng.randint(0, 12)):
            w = rng.choice([1, 2, 3, 4, 8, 16])
            a = rng.randint(0, w - 1)
            steps.append((rng.randint(1, a + 1), w, a))  # a stop or max_tokens may cut the kept tokens short
        keep = rng.randint(0, len(steps))
        st = RequestStats()
        for s in steps:
            st.record_step(*s)
        st.rollback(1 + sum(k for k, _, _ in steps[:keep]))
        kept = steps[:keep]
        assert st.acceptance_lengths == [k for k, _, _ in kept]
        assert (st.position_accepts, st.position_drafted) == _by_definition(kept), (steps, keep)
        assert len(st.as_dict().get("position_acceptance", [])) == max((w - 1 for _, w, _ in kept), default=0)
        for s in steps[keep:]:  # run again: counted once
            st.record_step(*s)
        assert (st.position_accepts, st.position_drafted) == _by_definition(steps)


def test_a_rollback_to_no_output_drops_every_step():
    st = RequestStats()
    for s in [(3, 4, 2), (1, 8, 0)]:
        st.record_step(*s)
    st.rollback(0)
    assert (st.acceptance_lengths, st.position_accepts, st.position_drafted, st.tau) == ([], [], [], None)

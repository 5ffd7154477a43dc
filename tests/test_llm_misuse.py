"""The Python API (`flashpd.LLM`) against misuse, on the shipped demo pair (CPU, float32): calls from several
threads get their own tokens; an interrupted generate gives every KV block back; non-integer ids and parameters
are refused, not truncated.
"""
from __future__ import annotations

import _thread
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from flashpd import LLM, SamplingParams

DEMO = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(target=DEMO / "target", draft=DEMO / "drafter", device="cpu", dtype="float32", kv_cache_tokens=8192)


def _free(llm: LLM) -> int:
    a = llm.runner.allocator
    return a.num_free


def test_calls_from_several_threads_get_their_own_tokens(llm):
    ids = llm.encode(TEXT)
    prompts = [ids[i:i + 12] for i in (0, 7, 15, 23)]
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    solo = [llm.generate([q], p)[0].token_ids for q in prompts]
    got: list[list[int] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        for _ in range(2):
            got[i] = llm.generate([prompts[i]], p)[0].token_ids

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert got == solo


def test_an_interrupted_generate_gives_every_block_back(llm):
    """Ctrl-C (KeyboardInterrupt in the main thread) at several points of a run: each time every KV block is
    free afterwards, and the next request is exact. SIGINT's handler is Python's default while it runs, as at a
    terminal: `interrupt_main` calls whatever handler the process has, and one left by other code in this test
    process would make no KeyboardInterrupt (once, with four test processes, none of the four runs was
    interrupted)."""
    ids = llm.encode(TEXT * 4)
    p = SamplingParams(max_tokens=200, ignore_eos=True)
    ref = llm.generate([ids[:40]], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    free = _free(llm)
    interrupted = 0
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for delay in (0.05, 0.2, 0.5, 1.0):
            timer = threading.Timer(delay, _thread.interrupt_main)
            timer.start()
            try:
                llm.generate([ids[:40], ids[10:60], ids[20:90]], p)
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                timer.cancel()
            assert _free(llm) == free, f"blocks leaked after an interrupt at {delay} s"
            assert llm.generate([ids[:40]], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids == ref
    finally:
        signal.signal(signal.SIGINT, found)
    assert interrupted >= 2, f"the runs ended before the interrupts: nothing was tested (SIGINT's handler was {found})"


@pytest.mark.parametrize("kw", [{"max_tokens": 2.5}, {"top_k": 2.5}, {"seed": 1.5}, {"max_tokens": True},
                                {"temperature": "1"}, {"ignore_eos": 1}])
def test_non_integer_parameters_are_refused(llm, kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        llm.generate([[5, 7]], SamplingParams(**kw))


def test_token_ids_must_be_integers(llm):
    with pytest.raises(ValueError, match="integers"):
        llm.encode([5, 7.9])
    with pytest.raises(ValueError, match="integers"):
        llm.encode([5, True])
    assert llm.encode([np.int64(5), 7]) == [5, 7]
    out = llm.generate([[5, 7]], SamplingParams(max_tokens=np.int64(3), ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_prompt_containers_are_read_as_prompts_or_refused_by_name(llm):
    """A numpy array or a torch tensor of ids is one prompt, as a list is (numpy ids failed as 'not iterable', an
    array as an ambiguous truth value); bytes ran as the ids of their bytes, a dict as its keys, a generator failed
    unsubscriptable: each is refused naming the type. An empty list of sampling params was read as none given (the
    defaults), not as the wrong count; a dict of them failed with an AttributeError."""
    import torch

    p = SamplingParams(max_tokens=3, ignore_eos=True)
    ref = llm.generate([[5, 6, 7]], p)[0].token_ids
    for prompt in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), np.int64(6), np.int64(7)], (5, 6, 7),
                   [np.array([5, 6, 7])]):
        out = llm.generate(prompt, p)
        assert len(out) == 1 and out[0].token_ids == ref, type(prompt)
    for prompt in (range(5, 8), [range(5, 8)], __import__("collections").deque([5, 6, 7])):
        assert llm.generate(prompt, p)[0].token_ids == ref, type(prompt)
    texts = list(np.array([TEXT[:20], TEXT[20:40]]))  # numpy strings: texts, not ids
    plain = [TEXT[:20], TEXT[20:40]]
    assert [o.token_ids for o in llm.generate(texts, p)] == [o.token_ids for o in llm.generate(plain, p)]
    for bad in (b"abc", memoryview(b"abc"), [b"abc"], {"a": 1}, (i for i in [5, 6])):
        with pytest.raises(ValueError, match="bytes|memoryview|dict|generator"):
            llm.generate(bad, p)
    with pytest.raises(ValueError, match="0 sampling params for 1 prompts"):
        llm.generate([[5, 6, 7]], [])
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams"):
        llm.generate([[5, 6, 7]], {"max_tokens": 3})
    assert llm.generate([[5, 6, 7]], (p,))[0].token_ids == ref


@pytest.mark.parametrize("width", [2.5, True, "4", "torch-2.5"])
def test_a_draft_width_that_is_no_integer_is_refused_at_load(width):
    """LLM(block_size=2.5) loaded, and every generate then failed deep in torch."""
    if width == "torch-2.5":
        import torch
        width = torch.tensor(2.5)
    with pytest.raises(ValueError, match="block_size"):
        LLM(target=DEMO / "target", draft=DEMO / "drafter", device="cpu", dtype="float32", block_size=width)

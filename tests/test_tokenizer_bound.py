"""TextTokenizer.tokens_over: a text surely past the limit is refused by windows, never encoded whole; a text that
fits is never refused by it.

Found by a review: a prompt of 4-byte characters under the character bound (262,000 emoji, 1 MiB) was encoded
whole, a million tokens and about 230 MB in the tokenizers library, before the server refused it; eight at once
took 2 GB of the serving process.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flashpd.engine import tokenizer as tokenizer_mod
from flashpd.engine.tokenizer import TextTokenizer

DEMO = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair" / "target"
PIECES = ["hello", " world", "  ", "\n", "\n\n", "🙂", "é", "中文", "<|endoftext|>", "<|mask|>", "a" * 40, " " * 30,
          "def f(x):\n    return x\n", "\t", "123456", "!?", "\u0301"]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_dir(DEMO)


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


@pytest.mark.parametrize("window", [24, 64, 256])
def test_a_text_that_fits_is_never_refused_and_a_refusal_is_a_lower_bound(tok, monkeypatch, window):
    """Random texts of words, space and newline runs, emoji, combining marks and special tokens' text, with the
    window small enough for many cuts: where the whole text has at most `limit` tokens the answer is None; where it
    says "over", the whole text has at least that many tokens, and more than the limit."""
    monkeypatch.setattr(tokenizer_mod, "WINDOW_CHARS", window)
    rng = random.Random(window)
    refused = 0
    for _ in range(150):
        text = _text(rng, rng.randrange(1, 400))
        n = len(tok.encode(text))
        for limit in (max(1, n - 300), max(1, n - 70), max(1, n - 1), n, n + 1, n + 100):
            over = tok.tokens_over(text, limit)
            if n <= limit:
                assert over is None, (window, limit, n, over, text[:80])
            elif over is not None:
                refused += 1
                assert limit < over <= n, (window, limit, n, over)
    assert refused > 0 or window < 256, refused  # windows of more tokens than a cut's slack do refuse


def test_four_byte_characters_are_refused_at_the_first_window(tok, monkeypatch):
    calls: list[int] = []
    orig = tok._tok.encode_batch

    class Spy:
        def __getattr__(self, name):
            return getattr(orig.__self__, name)

        def encode_batch(self, texts, **kw):
            calls.append(sum(len(t) for t in texts))
            return orig(texts, **kw)

    monkeypatch.setattr(tok, "_tok", Spy())
    text = "🙂" * 262_000
    over = tok.tokens_over(text, 4096)
    assert over is not None and over > 4096
    assert calls == [tokenizer_mod.WINDOW_CHARS], calls  # one window, not the whole text
    assert tok.tokens_over("🙂" * 1024, 4096) is None and calls[1:] == []  # 4 bytes a character: surely fits


def test_the_apis_refuse_such_a_prompt_by_the_bound(tok):
    """The HTTP API and the gRPC servicer refuse it with their "cannot fit" errors, from the window count."""
    from flashpd.cluster.http_api import build_app
    from fastapi.testclient import TestClient
    from tests.test_http_guard import _SlowBackend

    be = _SlowBackend(gap_s=0.0)
    be.max_positions = 4096
    with TestClient(build_app(be, tok, "fake", None)) as c:
        r = c.post("/v1/completions", content=json.dumps({"model": "fake", "prompt": "🙂" * 262_000}, ensure_ascii=False).encode())
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "at least" in r.json()["error"]["message"]
    from flashpd.cluster.generation_client import GenerationClient, GenerationResourceExhausted
    from flashpd.cluster.generation_server import serve_generation

    server, port = serve_generation(be, tokenizer=tok)
    client = GenerationClient(f"127.0.0.1:{port}", timeout_s=30)
    try:
        with pytest.raises(GenerationResourceExhausted, match="at least"):
            client.generate_once("🙂" * 262_000, max_tokens=4)
    finally:
        client.close()
        server.stop(None)

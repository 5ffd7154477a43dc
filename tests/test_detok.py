"""cluster/detok.py: streamed text pieces add up to the decode of all tokens, whatever the chunking (characters
split across tokens included), and the decoding work grows linearly with the tokens, not quadratically."""
from __future__ import annotations

import random
from pathlib import Path

from flashpd.cluster.detok import Detokenizer
from flashpd.engine.tokenizer import TextTokenizer

TOK = TextTokenizer.from_dir(Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair" / "target")


class _Counting:
    """The tokenizer, counting the ids it was asked to decode."""

    def __init__(self, tok) -> None:
        self.tok, self.ids = tok, 0

    def decode(self, ids: list[int]) -> str:
        self.ids += len(ids)
        return self.tok.decode(ids)


def _stream(ids: list[int], chunks: list[int], tok=TOK) -> tuple[list[str], str]:
    d, pieces, i = Detokenizer(tok), [], 0
    for n in chunks:
        pieces.append(d.push(ids[i:i + n]))
        i += n
    return pieces, d.finish()


def test_pieces_add_up_to_the_whole_text():
    rng = random.Random(0)
    text = "def f(x):\n    return 'é ü — 中文 🙂' + x  # émoji\n" * 3
    real = TOK.encode(text)
    for trial in range(300):
        ids = real if trial % 2 else [rng.randrange(TOK._tok.get_vocab_size()) for _ in range(rng.randint(1, 80))]
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 5)))
            left -= chunks[-1]
        pieces, rest = _stream(ids, chunks)
        assert "".join(pieces) + rest == TOK.decode(ids)
        assert not any(p.endswith("\ufffd") for p in pieces)  # an incomplete character waits for its bytes


def test_decoding_work_is_linear_in_the_tokens():
    ids = TOK.encode("for i in range(10):\n    print(i * 2, 'ok')\n" * 60)
    assert len(ids) > 500
    counting = _Counting(TOK)
    pieces, rest = _stream(ids, [1] * len(ids), counting)
    assert "".join(pieces) + rest == TOK.decode(ids)
    assert counting.ids <= 8 * len(ids), counting.ids  # all ids at every token would be about len(ids)^2 / 2


def test_no_tokenizer_no_text():
    d = Detokenizer(None)
    assert d.push([1, 2]) == "" and d.finish() == ""

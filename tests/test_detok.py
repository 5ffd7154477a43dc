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


def _byte_fallback_tokenizer():
    """A real `tokenizers` tokenizer with Llama's decoder (byte tokens <0x00>..<0xFF>, ByteFallback): a run of byte
    tokens decodes as UTF-8 when the whole run is valid, else as one U+FFFD per byte."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁the": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])

    class _Tok:
        def decode(self, ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=True)

    return _Tok()


def test_a_decode_that_disagrees_with_the_window_drops_no_text(caplog):
    """"a" as a byte token, then the first byte of a 3-byte character (max_tokens cut it): the window hands out "a",
    but the whole run [0x61, 0xE4] is invalid, so the full decode is two U+FFFD and does not begin with "a". The
    last token's text must still come out (it was silently dropped), and the mismatch is logged."""
    tok = _byte_fallback_tokenizer()
    a, e4 = 1 + 0x61, 1 + 0xE4
    assert tok.decode([a]) == "a" and tok.decode([a, e4]) == "\ufffd\ufffd"
    d = Detokenizer(tok)
    assert d.push([a]) == "a" and d.push([e4]) == ""
    with caplog.at_level("WARNING", logger="flashpd.cluster.detok"):
        assert d.finish() == "\ufffd"
    assert "not a prefix" in caplog.text
    # where they agree, nothing changes: the rest is the full decode's, and nothing is logged
    caplog.clear()
    d = Detokenizer(tok)
    pieces = [d.push([t]) for t in (a, 1 + 0xE4, 1 + 0xB8, 1 + 0xAD, 257, 1 + 0xE4)]
    with caplog.at_level("WARNING", logger="flashpd.cluster.detok"):
        rest = d.finish()
    assert "".join(pieces) + rest == tok.decode([a, 1 + 0xE4, 1 + 0xB8, 1 + 0xAD, 257, 1 + 0xE4]) and not caplog.text


def test_tokens_without_text_do_not_make_decoding_quadratic():
    """Special tokens decode to nothing (skip_special_tokens), so they never hand out text; they used to stay in the
    window, which then grew by one at every token and was decoded whole each time: with ignore_eos, a model that
    repeats <|endoftext|> cost len(ids)^2 decoded ids (8 million for 4000 tokens, on the server's event loop)."""
    eos = TOK._tok.token_to_id("<|endoftext|>")
    assert eos is not None and TOK.decode([eos]) == ""
    ids = TOK.encode("def f(x):\n") + [eos] * 2000 + TOK.encode("    return x\n") + [eos] * 2000 + [eos, 1]
    for chunks in ([1] * len(ids), [3] * (len(ids) // 3) + [len(ids) % 3]):
        counting = _Counting(TOK)
        pieces, rest = _stream(ids, chunks, counting)
        assert "".join(pieces) + rest == TOK.decode(ids) == "def f(x):\n    return x\n"
        assert counting.ids <= 8 * len(ids), counting.ids


def test_text_held_back_at_every_push_is_decoded_in_linear_work():
    """Where every push leaves the text ending inside a character (byte tokens that never form valid UTF-8, or valid
    text whose chunks all end inside one), the window grew by a chunk a push and was decoded whole each time:
    len(ids)^2 / 2 decoded ids (32 million for 8000 tokens, about 3 s of the server's interpreter lock, for as many
    tokens as a client's max_tokens asks). The settled part of the held text is handed out instead, and the pieces
    still add up to the decode of all ids."""
    cont, lead, mid, c3, a9 = (TOK._tok.token_to_id(c) for c in "Ģä¸Ã©")  # byte-level BPE's 80 E4 B8 C3 A9
    eos = TOK._tok.token_to_id("<|endoftext|>")
    assert TOK.decode([cont]) == TOK.decode([lead]) == TOK.decode([lead, mid]) == "\ufffd"
    assert TOK.decode([c3, a9]) == "é"
    cases = [(run * (2000 // len(run)), n) for run in ([cont], [lead], [lead, mid], [lead, eos]) for n in (1, 3)]
    cases.append(([c3, a9] * 1000, 2))  # é as two byte tokens, two a push after one: every push ends inside an é
    for run, n in cases:
        ids = TOK.encode("x") + run + TOK.encode("中'\n")
        counting = _Counting(TOK)
        pieces, rest = _stream(ids, [1] + [min(n, len(ids) - i) for i in range(1, len(ids), n)], counting)
        assert "".join(pieces) + rest == TOK.decode(ids)
        assert counting.ids <= 40 * len(ids), counting.ids  # measured: up to 30 a token


def test_a_cut_of_a_byte_fallback_run_keeps_its_text():
    """ByteFallback decodes a run of byte tokens as a whole (all U+FFFD once it is invalid), so a window that starts
    inside a run can decode it otherwise: a cut is taken only where the window it leaves decodes as the whole one,
    also at its last few ends (the run's tail [61 E4 A9 AD C3] is invalid by its last byte only, and valid "a䩭í"
    after one more). These streams came out short of text (U+FFFD lost) with cuts not so checked."""
    tok = _byte_fallback_tokenizer()
    the = 257
    for raw in ([0xA9, 0x61, 0x80, 0xE4, 0xE4, 0xA9, 0xA9, 0xC3, 0xA9, the],
                [0x80, 0xAD, 0xB8, 0xC3, 0x61, 0xE4, 0xA9, 0xAD, 0xC3, 0xAD, the],
                [the] + [0x80] * 1000 + [0xE4, 0xB8, 0xAD, the]):
        ids = [t if t == the else 1 + t for t in raw]
        counting = _Counting(tok)
        pieces, rest = _stream(ids, [1] * len(ids), counting)
        assert "".join(pieces) + rest == tok.decode(ids)
        assert counting.ids <= 40 * len(ids), counting.ids

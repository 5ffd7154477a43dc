"""Tokenizer of a model directory (tokenizer.json through the `tokenizers` library), optional."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from flashpd.engine.config import CheckpointError, optional_file, read_json_object


WINDOW_CHARS = 16384  # tokens_over's window
CUT_SLACK = 64  # tokens a window cut may add (a pre-token, or a special token's text, split in two)


class TextTokenizer:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001  the tokenizers library raises a bare Exception for a bad file
            raise CheckpointError(f"{path}: unreadable tokenizer.json ({e})") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TextTokenizer | None":
        """The directory's tokenizer.json (None without one), checked against its config.json's vocab_size."""
        p = Path(model_dir) / "tokenizer.json"
        if not optional_file(p, model_dir):
            return None
        tok = cls(p)
        cfg = Path(model_dir) / "config.json"
        if cfg.exists():
            vocab = read_json_object(cfg).get("vocab_size")
            if isinstance(vocab, int) and not isinstance(vocab, bool):  # (its type: the model loader's error)
                tok.check_vocab(vocab, f"{cfg}: vocab_size")
        return tok

    def check_vocab(self, vocab_size: int, what: str) -> None:
        """Every id this tokenizer can produce indexes the model's embedding: an id past it (another model's
        tokenizer) would fail a text prompt deep in the forward, or on a GPU take the whole engine down."""
        top = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        if top >= vocab_size:
            raise CheckpointError(f"{self.path}: tokenizer has token id {top}, outside {what} {vocab_size} "
                                  f"(a tokenizer of another model?)")

    def encode(self, text: str) -> list[int]:
        """By the library's batch call, which lets go of the interpreter lock while it works (its single encode
        holds it throughout: a 260k-character prompt, 0.15 s, stalled every stream of a server and, in-process,
        the engine loop); the same ids."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def tokens_over(self, text: str, limit: int) -> int | None:
        """How many tokens `text` has at least, when that is surely more than `limit`; None when it may fit. Counted
        window by window (WINDOW_CHARS characters, cut before a space where one is near), stopping once past the
        limit: the tokenizer's memory is a window's, whatever the text. A whole text of 4-byte characters under the
        character bound (1 MiB of emoji) encoded to a million tokens, about 230 MB in the library, before the prompt
        was refused; eight at once took 2 GB. A window cut can add tokens (a pre-token split in two): each cut is
        allowed CUT_SLACK of them before the count says "over", so a text that fits is never refused here. A text
        that fits is tokenized twice past one window (about 0.1 us a character more, off the event loop)."""
        if 4 * len(text) <= limit or len(text) <= WINDOW_CHARS:  # a token holds at least one UTF-8 byte, a character
            return None  # at most four; one window's whole encode is what a window costs (no count twice)
        total = cuts = start = 0
        while start < len(text):
            end = min(len(text), start + WINDOW_CHARS)
            if end < len(text):
                space = text.rfind(" ", start + WINDOW_CHARS // 2, end)  # pre-tokens start at a space: kept whole
                end = space if space > start else end
                cuts += 1
            total += len(self._tok.encode_batch([text[start:end]], add_special_tokens=False)[0].ids)
            if total > limit + CUT_SLACK * cuts:
                return total - CUT_SLACK * cuts
            start = end
        return None

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Several texts at once (the tokenizers library spreads a batch over the cores)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

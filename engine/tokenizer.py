"""Tokenizer of a model directory (tokenizer.json through the `tokenizers` library), optional."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from flashpd.engine.config import CheckpointError, read_json_object


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
        if not p.exists():
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

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Several texts at once (the tokenizers library spreads a batch over the cores)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

"""Tokenizer of a model directory (tokenizer.json through the `tokenizers` library), optional."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from flashpd.engine.config import CheckpointError


class TextTokenizer:
    def __init__(self, path: Path) -> None:
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001  the tokenizers library raises a bare Exception for a bad file
            raise CheckpointError(f"{path}: unreadable tokenizer.json ({e})") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TextTokenizer | None":
        p = Path(model_dir) / "tokenizer.json"
        return cls(p) if p.exists() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Several texts at once (the tokenizers library spreads a batch over the cores)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

"""Incremental detokenization for the streaming APIs (gRPC and HTTP): each token costs two decodes of a short
window, not a decode of everything so far.

A stream's text is handed out as tokens arrive. Decoding all ids at every chunk costs O(n) per chunk and O(n^2) a
request: a long answer streamed a token at a time then holds the server process's interpreter lock, which every
stream and the engine loop share, far longer than its tokens took to compute. Here a chunk decodes the window from the token before the
last handed-out text (`prefix`) to the end, and hands out what it adds to the window's earlier part; a trailing
incomplete character (U+FFFD) is held back until it resolves. `finish` reconciles with the decode of all ids, so
the pieces add up to the whole text.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        """tokenizer: anything with decode(ids) -> str (engine/tokenizer.TextTokenizer); None hands out no text."""
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the window starts at `prefix`; text up to `read` is handed out
        self.decoded = ""  # all text handed out so far

    def push(self, toks: list[int]) -> str:
        """The text these tokens add (possibly empty: a character still incomplete)."""
        if self.tok is None:
            return ""
        self.ids.extend(toks)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            new = after[len(before):]
            self.decoded += new
            return new
        return ""

    def finish(self) -> str:
        """The rest of the text once the stream ended: the decode of all ids past what was handed out (a trailing
        incomplete character included)."""
        if self.tok is None:
            return ""
        full = self.tok.decode(self.ids)
        rest = full[len(self.decoded):] if full.startswith(self.decoded) else ""
        self.decoded += rest
        return rest

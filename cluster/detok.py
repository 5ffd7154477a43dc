"""Incremental detokenization for the streaming APIs (gRPC and HTTP): each token costs two decodes of a short
window, not a decode of everything so far.

A stream's text is handed out as tokens arrive. Decoding all ids at every chunk costs O(n) per chunk and O(n^2) a
request: a long answer streamed a token at a time then holds the server process's interpreter lock, which every
stream and the engine loop share, far longer than its tokens took to compute. Here a chunk decodes the window from
the token before the last handed-out text to the end, and hands out what it adds to the window's earlier part; a
trailing incomplete character (U+FFFD) is held back until it resolves, and tokens that add no text (special
tokens, which a decode skips) leave the window at once, or a model repeating one would make it quadratic again.
`finish` reconciles with the decode of all ids, so the pieces add up to the whole text. Where the two cannot agree
(a decoder whose output for a token depends on neighbours beyond the window: ByteFallback turns a whole run of
byte tokens into U+FFFD once any of them is invalid, so a run the window saw as valid may not be one in the
whole), the text handed out stands and the tokens not yet handed out are decoded on their own: no text is
dropped, and the mismatch is logged.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        """tokenizer: anything with decode(ids) -> str (engine/tokenizer.TextTokenizer); None hands out no text."""
        self.tok = tokenizer
        self.ids: list[int] = []  # every id so far (finish decodes them all)
        self.win: list[int] = []  # the window: the ids of the last text handed out, and those after them
        self.read = 0  # win[:read] is handed out
        self.taken = 0  # ids[:taken] are handed out, or were dropped from the window as adding no text
        self.decoded = ""  # all text handed out so far

    def push(self, toks: list[int]) -> str:
        """The text these tokens add (possibly empty: a character still incomplete)."""
        if self.tok is None:
            return ""
        self.ids.extend(toks)
        before = self.tok.decode(self.win[:self.read])
        self.win.extend(toks)
        after = self.tok.decode(self.win)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.win, self.read, self.taken = self.win[self.read:], len(self.win) - self.read, len(self.ids)
            new = after[len(before):]
            self.decoded += new
            return new
        if after == before:  # tokens with no text here (special tokens, which a decode skips) leave the window:
            del self.win[len(self.win) - len(toks):]  # kept, it would grow with each and be decoded whole each time
            if len(self.win) == self.read:
                self.taken = len(self.ids)
        return ""

    def finish(self) -> str:
        """The rest of the text once the stream ended: the decode of all ids past what was handed out (a trailing
        incomplete character included); where the decode of all ids does not begin with the text handed out, the
        decode of the ids not yet handed out (logged)."""
        if self.tok is None:
            return ""
        full = self.tok.decode(self.ids)
        if full.startswith(self.decoded):
            rest = full[len(self.decoded):]
        else:
            rest = self.tok.decode(self.ids[self.taken:]) if self.taken < len(self.ids) else ""
            log.warning("detokenizer: the streamed text (%d chars) is not a prefix of the whole decode (%d chars); "
                        "the last %d tokens' text is decoded on its own", len(self.decoded), len(full),
                        len(self.ids) - self.taken)
        self.decoded += rest
        self.taken = len(self.ids)
        return rest

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
Text held back at every push (byte tokens that never form valid UTF-8, or valid text whose chunks all end inside a
character) would keep the window growing, each push decoding it whole: quadratic again, for as many tokens as a
client's max_tokens asks. Once text was held back for more than _HELD pushes in a row, its settled part (the text of
a cut of the window that the rest of the window no longer changes) is handed out and the window moves on.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_HELD = 4  # pushes in a row that hold text back before a cut of the held run is sought (a character: 4 bytes)
_HELD_MAX = 16  # pushes in a row that hold text back before the window is cut even with no settled cut
_CUTS = 3  # cut points tried, from the end (of 4 consecutive byte tokens' ends, one ends a character)


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        """tokenizer: anything with decode(ids) -> str (engine/tokenizer.TextTokenizer); None hands out no text."""
        self.tok = tokenizer
        self.ids: list[int] = []  # every id so far (finish decodes them all)
        self.win: list[int] = []  # the window: the ids of the last text handed out, and those after them
        self.read = 0  # win[:read] is handed out
        self.taken = 0  # ids[:taken] are handed out, or were dropped from the window as adding no text
        self.decoded = ""  # all text handed out so far
        self.held = 0  # pushes in a row that held text back (past _HELD, _cut hands out its settled part)

    def push(self, toks: list[int]) -> str:
        """The text these tokens add (possibly empty: a character still incomplete)."""
        if self.tok is None:
            return ""
        self.ids.extend(toks)
        before = self.tok.decode(self.win[:self.read])
        self.win.extend(toks)
        after = self.tok.decode(self.win)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            return self._hand_out(len(self.win), after[len(before):])
        if after == before:  # tokens with no text here (special tokens, which a decode skips) leave the window:
            del self.win[len(self.win) - len(toks):]  # kept, it would grow with each and be decoded whole each time
            if len(self.win) == self.read:
                self.taken = len(self.ids)
        else:
            self.held += 1
            if self.held > _HELD and len(self.win) - self.read > _HELD:
                return self._cut(before, after)
        return ""

    def _cut(self, before: str, after: str) -> str:
        """The settled text of a long held run, handed out so that the window stays short: the decode of win[:s]
        for the last cut s where it is a prefix of the window's decode that more text follows (what comes later can
        then only change the text after it: the character at the cut ended), if the window that follows decodes as
        the whole one does (_window_agrees). Past _HELD_MAX such pushes with no such cut, the window is cut at its
        last token anyway (a mismatch that finish logs)."""
        n = len(self.win)
        for s in range(n - 1, max(self.read, n - 1 - _CUTS), -1):
            head = self.tok.decode(self.win[:s])
            if len(before) < len(head) < len(after) and after.startswith(head):
                if self._window_agrees(after):
                    return self._hand_out(s, head[len(before):])
                break
        if self.held <= _HELD_MAX:
            return ""
        return self._hand_out(n - 1, self.tok.decode(self.win[:n - 1])[len(before):])

    def _window_agrees(self, after: str) -> bool:
        """Whether win[read:], the window a cut leaves, decodes as the whole window does at its first token and its
        last _CUTS + 1 ends: the same text, bar what its first token's text loses at a window's start (a stripped
        leading space). ByteFallback decodes a run of byte tokens as a whole, and a run's tail can be valid UTF-8
        where the run is not; if the tail can still become valid, one of those ends is valid on its own."""
        n, r = len(self.win), self.read + 1
        ends = [r, *range(max(r + 1, n - _CUTS), n + 1)]
        part = {j: self.tok.decode(self.win[self.read:j]) for j in ends}
        whole = {j: after if j == n else self.tok.decode(self.win[:j]) for j in ends}
        lost = len(whole[n]) - len(part[n])
        return all(len(whole[j]) - len(part[j]) == lost and whole[j].endswith(part[j][1:]) for j in ends)

    def _hand_out(self, s: int, new: str) -> str:
        """Hands out new, the text of win[read:s]; the window then starts at the ids of that text."""
        self.taken = len(self.ids) - (len(self.win) - s)
        self.win, self.read, self.held = self.win[self.read:], s - self.read, 0
        self.decoded += new
        return new

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

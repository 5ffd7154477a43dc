"""Host time of a stream's incremental detokenization, per request, against decoding all tokens at every chunk.

    python -m flashpd.bench.detok_cost --out bench/results/detok_cost.json

The server process's streams and its engine loop share one interpreter lock, so every millisecond a stream
spends decoding text is a millisecond the engine cannot step. This times cluster/detok.Detokenizer (two window
decodes a chunk) and the form it replaced (a decode of all ids at every chunk) over the demo pair's tokenizer,
for answers of several lengths streamed a few tokens a chunk; it also checks that the pieces add up to the text.
"""
from __future__ import annotations

import argparse
import random
import time

from flashpd.bench.common import command_line, write_json
from flashpd.demo import PAIR
from flashpd.cluster.detok import Detokenizer
from flashpd.engine.tokenizer import TextTokenizer

DEMO = PAIR / "target"  # wherever the package is installed


class WholeDecode:
    """The replaced form: all ids decoded at every chunk, the new suffix handed out."""

    def __init__(self, tok) -> None:
        self.tok, self.ids, self.sent = tok, [], ""

    def push(self, toks: list[int]) -> str:
        self.ids.extend(toks)
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        new = full[len(self.sent):] if full.startswith(self.sent) else full
        self.sent = full
        return new

    def finish(self) -> str:
        full = self.tok.decode(self.ids)
        new = full[len(self.sent):] if full.startswith(self.sent) else full
        self.sent = full
        return new


def stream_ms(make, tok, ids: list[int], per: int, reps: int) -> tuple[float, bool]:
    """Best of reps: ms to stream ids `per` a chunk; whether the pieces equal the whole decode."""
    best, ok = float("inf"), True
    for _ in range(reps):
        t = time.perf_counter()
        d, out = make(tok), []
        for i in range(0, len(ids), per):
            out.append(d.push(ids[i:i + per]))
        out.append(d.finish())
        best = min(best, time.perf_counter() - t)
        ok = ok and "".join(out) == tok.decode(ids)
    return best * 1e3, ok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-dir", default=str(DEMO))
    ap.add_argument("--lengths", default="64,512,2048")
    ap.add_argument("--per-chunk", default="1,4", help="tokens a chunk (native streams 1; DFlash about tau)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    tok = TextTokenizer.from_dir(a.tokenizer_dir)
    if tok is None:
        raise SystemExit(f"no tokenizer.json in {a.tokenizer_dir}")
    rng = random.Random(a.seed)
    rows = []
    for n in (int(x) for x in a.lengths.split(",")):
        ids = [rng.randrange(5, tok._tok.get_vocab_size()) for _ in range(n)]
        for per in (int(x) for x in a.per_chunk.split(",")):
            window, ok_w = stream_ms(Detokenizer, tok, ids, per, a.reps)
            whole, ok_a = stream_ms(WholeDecode, tok, ids, per, a.reps)
            rows.append({"tokens": n, "per_chunk": per, "window_ms": window, "whole_decode_ms": whole,
                         "window_text_exact": ok_w, "whole_decode_text_exact": ok_a})
            print(f"{n} tokens, {per} a chunk: window {window:.2f} ms, whole decode {whole:.2f} ms a request")
    write_json(a.out, {"bench": "detok_cost", "command": command_line("flashpd.bench.detok_cost", argv),
                       "rows": rows})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

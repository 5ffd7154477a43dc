"""The HTTP front door's count of a body's JSON values before it parses it (http_api._check_shape): a body over
the bound is refused, text full of brackets and commas inside strings is not, and the count is linear."""
from __future__ import annotations

import json
import random
import time

import pytest

from flashpd.cluster.http_api import APIError, _check_shape, _outside_strings, _separators

NASTY = ['"', "\\", "[", "]", "{", "}", ",", ":", "a", "\\\\", '\\"', "\u00e9", "\n"]


def _structure(v: object) -> object:
    """v with every string (keys too) empty: what a parser sees outside strings."""
    if isinstance(v, dict):
        return {f"{i}": _structure(x) for i, x in enumerate(v.values())}
    if isinstance(v, list):
        return [_structure(x) for x in v]
    return "" if isinstance(v, str) else v


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(5 if depth < 4 else 3)
    if kind == 0:
        return "".join(rng.choice(NASTY) for _ in range(rng.randrange(12)))
    if kind == 1:
        return rng.randrange(-5, 500)
    if kind == 2:
        return rng.choice([None, True, 1.5])
    if kind == 3:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {"".join(rng.choice(NASTY) for _ in range(rng.randrange(6))) + str(i): _random_value(rng, depth + 1)
            for i in range(rng.randrange(5))}


def test_the_count_outside_strings_is_the_parsers_structure():
    """For 500 random bodies with quotes, backslashes and brackets in their strings and keys: the recount equals
    the separators of the same body with every string emptied (key order and numbers kept)."""
    rng = random.Random(7)
    for _ in range(500):
        v = _random_value(rng)
        for ensure_ascii in (True, False):
            raw = json.dumps(v, ensure_ascii=ensure_ascii).encode()
            want = json.dumps(_structure(v), ensure_ascii=ensure_ascii).encode()
            assert _separators(_outside_strings(raw, 10_000)) == _separators(want), raw


def test_brackets_inside_a_prompt_pass_and_real_ones_are_refused():
    prompt = "[[" * 90_000 + ", :" * 50_000 + '\\"[' * 1000  # 180,000 brackets and 100,000 separators of text
    _check_shape(json.dumps({"prompt": prompt, "max_tokens": 4}).encode(), max_values=100_000)
    for body in (b"[" + b"{}," * 60_000 + b"{}]", b'{"prompt": [' + b"1," * 120_000 + b'1]}',
                 b'{"a": "\\\\", "b": [' + b"1," * 120_000 + b"1]}"):  # an escaped backslash ends its string
        with pytest.raises(APIError) as e:
            _check_shape(body, max_values=100_000)
        assert e.value.status == 413


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-16", "utf-32-le", "utf-32"])
def test_a_body_json_reads_as_utf16_or_utf32_keeps_the_raw_count(encoding):
    """json.loads guesses UTF-16 and UTF-32 from NUL bytes; there an escaped quote is not the bytes backslash-quote,
    and a character's byte can be a quote's: the recount would see the rest of the body as one string. A body of
    many values in those encodings is refused as the raw count says (it was let through, and parsed for 0.9 s)."""
    body = ('{"prompt": "\\"", "x": [' + "[0]," * 60_000 + "[0]]}").encode(encoding)
    with pytest.raises(APIError) as e:
        _check_shape(body, max_values=100_000)
    assert e.value.status == 413
    assert _outside_strings(body, 10 ** 9) is None


def test_a_body_of_more_strings_than_the_bounds_allow_is_not_recounted():
    """Within the bounds a body holds at most values + containers + 1 strings: past that the raw count stands, and
    the recount's work stays bounded by the bounds, not by the body."""
    body = b"[" + b'"",' * 200_000 + b'""]'  # 200,001 separators: over the bound by the raw count and by any count
    assert _outside_strings(body, 150_001) is None
    with pytest.raises(APIError):
        _check_shape(body, max_values=100_000)


def test_a_body_of_escaped_quotes_is_counted_in_linear_time():
    """A regex over strings with their escapes goes quadratic on unterminated escaped quotes; the recount does not
    (4 MiB: well under a second where a quadratic scan would take hours). One closed string passes; left open, its
    text counts (json.loads fails at it, but parses what comes before: never an undercount)."""
    run = b'\\"[' * (4 * 2 ** 20 // 3)
    t0 = time.perf_counter()
    _check_shape(b'"' + run + b'"', max_values=100_000)  # one string: nothing outside it
    with pytest.raises(APIError):
        _check_shape(b'"' + run, max_values=100_000)
    assert time.perf_counter() - t0 < 5.0

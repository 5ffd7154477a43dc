"""The HTTP API's sampling defaults from the model's generation_config.json (http_api.sampling_defaults): values a
request could not carry refuse the start naming the file (taken as they were, every request that left the field
unset was refused 400, blaming the client; a string was dropped without a word)."""
from __future__ import annotations

import json

import pytest

from flashpd.cluster.http_api import sampling_defaults


def _with(tmp_path, cfg) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_valid_defaults_are_taken_and_others_left_alone(tmp_path):
    got = sampling_defaults(_with(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "eos_token_id": 5}))
    assert got == {"temperature": 0.6, "top_p": 0.95, "top_k": 20} and isinstance(got["top_k"], int)
    assert sampling_defaults(_with(tmp_path, {"do_sample": True})) == {}
    assert sampling_defaults(str(tmp_path / "nowhere")) == {}


@pytest.mark.parametrize("cfg, key", [({"top_p": 7}, "top_p"), ({"top_p": 0}, "top_p"),
                                      ({"temperature": "hot"}, "temperature"), ({"temperature": -1}, "temperature"),
                                      ({"top_k": 2.5}, "top_k"), ({"top_k": -2}, "top_k"), ({"top_p": True}, "top_p"),
                                      ([1, 2], "must be a JSON object"), ({"top_k": 10 ** 400}, "top_k"),
                                      ({"temperature": 10 ** 400}, "temperature"),
                                      ({"temperature": float("inf")}, "temperature")])
def test_a_default_no_request_could_carry_refuses_the_start_by_name(tmp_path, cfg, key):
    with pytest.raises(ValueError, match=f"generation_config.json: {key}"):
        sampling_defaults(_with(tmp_path, cfg))

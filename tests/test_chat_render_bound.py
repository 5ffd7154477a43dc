"""A chat request cannot make the server render more than the model can hold, nor replace the special tokens.

Found by a review: with a template that prints eos_token every turn (Zephyr, Mistral-Instruct, Llama-2 styles),
`chat_template_kwargs: {"eos_token": "x" * 300000}` and 6,000 one-character messages, a 0.5 MB request rendered to
1.8 billion characters (3.7 GB, 1.65 s) before its length was checked.
"""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from flashpd.cluster.chat_template import ChatTemplate, ChatTemplateTooLong
from flashpd.cluster.http_api import build_app
from flashpd.engine.tokenizer import TextTokenizer
from tests.test_http_guard import _SlowBackend
from tests.test_tokenizer_bound import DEMO

ZEPHYR = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
          "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _msgs(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(n)]


def test_render_stops_at_max_chars_and_is_unchanged_below_it():
    t = ChatTemplate(ZEPHYR, {"eos_token": "</s>"})
    msgs = _msgs(6)
    whole = t.render(msgs)
    assert t.render(msgs, max_chars=len(whole)) == whole
    with pytest.raises(ChatTemplateTooLong, match=f"passed {len(whole) - 1} characters"):
        t.render(msgs, max_chars=len(whole) - 1)
    pieces = []
    orig = t.template.generate

    def spy(ctx):
        for p in orig(ctx):
            pieces.append(p)
            yield p

    t.template.generate = spy
    with pytest.raises(ChatTemplateTooLong):
        t.render(_msgs(6000), eos_token="x" * 300_000, max_chars=1_000_000)
    assert len(pieces) < 30  # stopped a few turns in, not after rendering 6,000 of them


@pytest.fixture(scope="module")
def client():
    be = _SlowBackend(gap_s=0.0)
    be.max_positions = 4096
    with TestClient(build_app(be, TextTokenizer.from_dir(DEMO), "fake", None,
                              chat_template=ChatTemplate(ZEPHYR, {"eos_token": "</s>"}))) as c:
        yield c


def _chat(client, **body):
    body = {"model": "fake", "max_tokens": 1, **body}
    return client.post("/v1/chat/completions", content=json.dumps(body).encode())


@pytest.mark.parametrize("name", ["eos_token", "bos_token", "additional_special_tokens"])
def test_a_request_cannot_replace_a_special_token(client, name):
    r = _chat(client, messages=_msgs(1), chat_template_kwargs={name: "x" * 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{name}", r.text


def test_a_conversation_rendered_past_the_context_is_refused_as_too_long(client):
    r = _chat(client, messages=[{"role": "user", "content": "b" * 60_000}] * 6)  # 360k characters > 4096 * 64
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "rendered prompt passed" in r.json()["error"]["message"]
    assert _chat(client, messages=_msgs(1)).status_code == 200

"""A target's chat template, rendered as transformers' `apply_chat_template` renders it (engine-free).

The template is `chat_template` in the model directory's tokenizer_config.json (a string, or a list of
{"name", "template"} of which "default" is taken), else a chat_template.jinja file beside it. It runs
in jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols
extension, a `{% generation %}` block (rendered as its body), a `tojson` filter that does not escape
HTML, and the globals `raise_exception` and `strftime_now`, with `messages`, `tools`, `documents`,
`add_generation_prompt` and the tokenizer's special tokens (bos_token, eos_token, ...) as variables.
The rendered text is then tokenized without adding special tokens, as transformers does.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flashpd.engine.config import optional_file

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the template refused it (raise_exception) or it is malformed."""


class ChatTemplateTooLong(ChatTemplateError):
    """The rendered prompt passed render's max_chars (it could not fit the model anyway)."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken dict with "content"."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.template = compile_template(source)  # raises jinja2.TemplateSyntaxError on a broken template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ChatTemplate | None":
        """The directory's template, or None when it has none. A template that does not compile raises."""
        d = Path(model_dir)
        cfg: dict = {}
        p = d / "tokenizer_config.json"
        if optional_file(p, d):
            cfg = json.loads(p.read_text(encoding="utf-8"))
        src = cfg.get("chat_template")
        if isinstance(src, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in src if isinstance(t, dict)}
            src = named.get("default")
        if not src and optional_file(d / "chat_template.jinja", d):
            src = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if not isinstance(src, str) or not src:
            return None
        special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(cfg.get(k))) is not None}
        extra = cfg.get("additional_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
        return cls(src, special)

    def render(self, messages: list[dict], /, add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list | None = None, documents: list | None = None, max_chars: int | None = None,
               **kwargs: Any) -> str:
        """The prompt text of a conversation. kwargs: extra template variables (e.g. enable_thinking),
        which override the special tokens of the same name. max_chars: rendering stops, ChatTemplateTooLong, once
        the text passes it (a template that prints a variable every turn multiplies a request's bytes: a 0.5 MB
        request rendered to 1.8 billion characters, 3.7 GB, before its length was checked). Raises
        ChatTemplateError."""
        msgs = [dict(m) for m in messages]
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be set")
            if not msgs or not isinstance(msgs[-1].get("content"), str):
                raise ChatTemplateError("continue_final_message: the final message has no text content to continue")
            final = msgs[-1]["content"]
            msgs[-1]["content"] = final + _CONTINUE_TAG
        ctx = {**self.special_tokens, **kwargs, "messages": msgs, "tools": tools, "documents": documents,
               "add_generation_prompt": add_generation_prompt}
        try:
            text = self.template.render(ctx) if max_chars is None else _bounded(self.template.generate(ctx), max_chars)
        except ChatTemplateTooLong:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the conversation: {e}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise ChatTemplateError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") \
                from None
        _check_rendered(messages, text)
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if tag not in text:
                raise ChatTemplateError("continue_final_message: the template dropped the final message")
            at = text.rindex(tag)
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text


def _bounded(pieces, max_chars: int) -> str:
    """The rendered pieces joined, or ChatTemplateTooLong as soon as they pass max_chars (the rest never made)."""
    out, n = [], 0
    for p in pieces:
        n += len(p)
        if n > max_chars:
            raise ChatTemplateTooLong(f"the rendered prompt passed {max_chars} characters")
        out.append(p)
    return "".join(out)


# Roles whose text a template may rewrite (an assistant turn's reasoning stripped, a tool result serialised): the
# rest must appear in the prompt as sent (trimmed)
_REWRITTEN_ROLES = ("assistant", "tool")


def _check_rendered(messages: list[dict], text: str) -> None:
    """A message the template left out is an error, not a silently shorter prompt: Qwen3's template renders only
    system, user, assistant and tool turns, so a 'developer' message (newer OpenAI clients send one) vanished.
    Messages render in order: each is looked for after the one before it, and in the whole text only if not
    there (a template may move one, as Qwen3's system turn). One search of the whole text per message made a
    1 MB body of 28,000 short messages cost 7 s of the serving process's CPU."""
    pos = 0
    for i, m in enumerate(messages):
        c = m.get("content")
        if m.get("role") in _REWRITTEN_ROLES or not isinstance(c, str) or not c.strip():
            continue
        at = text.find(c.strip(), pos)
        if at >= 0:
            pos = at + len(c.strip())
            continue
        if c.strip() not in text:
            hint = " (send a developer message as 'system')" if m.get("role") == "developer" else ""
            raise ChatTemplateError(f"the chat template left out messages[{i}] (role {m.get('role')!r}): this "
                                    f"model's template does not render that role here{hint}")


def load_chat_template(model_dir: str | Path) -> tuple[ChatTemplate | None, str | None]:
    """(template, None), (None, None) when the directory has none, or (None, why) when it is unusable
    (the server still serves completions; chat requests get the reason)."""
    try:
        return ChatTemplate.from_dir(model_dir), None
    except (OSError, ValueError, jinja2.TemplateError) as e:
        log.warning("the chat template of %s is unusable: %s", model_dir, e)
        return None, f"the model's chat template is unusable: {type(e).__name__}: {e}"

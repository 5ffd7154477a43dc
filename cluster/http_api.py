"""The OpenAI-compatible HTTP API (FastAPI) over the generation service's backend.

`build_app(backend, tokenizer, model_name, metrics, ...)` serves, beside the gRPC API and over the same
`Backend` (the colocated engine loop or the router):

- POST /v1/completions and /v1/chat/completions, streamed (server-sent events ending with
  `data: [DONE]`) or not. Parameters: model, prompt (a string, token ids, or a list of one of them) /
  messages, max_tokens (chat: max_completion_tokens too), temperature, top_p, seed, stop (at most 16 strings of
  at most 1,024 characters: the text ends before the first one, finish_reason "stop"), n (1 only), stream,
  stream_options.include_usage (with stream only);
  extra body fields as vLLM takes them: top_k, ignore_eos, method ("dflash" | "native"), block_size (the draft width),
  return_token_ids, and for chat add_generation_prompt, continue_final_message, chat_template_kwargs.
  Unknown fields are ignored; known ones flashpd cannot honour (penalties, logprobs, logit_bias, echo,
  tools, ...) are refused with a 400 naming them. `usage` counts prompt and completion tokens (a stop
  string's request counts the tokens up to the one that completed it). flashpd's own figures (method,
  tau, acceptance_lengths, ttft_ms, prefill_ms, latency_ms) are in one vendor field, "flashpd" (when
  streaming, on the chunk that carries the finish_reason).
- GET /v1/models, GET /health (200 while serving, else 503; the backend's counts and serving settings), GET
  /metrics (this process's Prometheus metrics).

Defaults: temperature 1.0 and top_p 1.0 (OpenAI's), overridden by the target's generation_config.json
(temperature, top_p, top_k) as vLLM does; max_tokens 16 for completions (OpenAI's), for chat what the
context and the KV cache leave. Chat prompts come from the target's chat template (cluster/chat_template.py).

Errors have OpenAI's body {"error": {"message", "type", "param", "code"}} and the status the gRPC code
would be: INVALID_ARGUMENT and FAILED_PRECONDITION -> 400, an unknown model -> 404, a prompt that cannot
fit (RESOURCE_EXHAUSTED) -> 400 with code "context_length_exceeded" (param max_tokens when the prompt alone
fits), no worker / engine stopped (UNAVAILABLE) -> 503, every decode worker overloaded -> 503 with Retry-After, a
request that failed alone (RequestFailed, INTERNAL) -> 500, a timeout -> 504.
A body over max_positions * 128 bytes (at least 1 MiB), or of more JSON values than a request of max_positions
tokens needs (`_check_shape`), gets 413. An error after a stream started is sent
as a `data: {"error": ...}` event before `data: [DONE]`.

A server that stops gives requests in flight most of its grace period, then ends each with a 503 (a stream:
an error event, then [DONE]). A request is cancelled in the backend (its KV blocks freed) whenever its response
does not run to the end: the client disconnects (mid-stream: the stream task is cancelled; non-streamed: polled), a stop
string ends the text, or anything fails. Blocking backend calls run on worker threads (one per request
at most), so the event loop never waits on the engine; so do parsing a request (tokenizing its prompt,
rendering its chat template), /health's and /metrics' reads of the backend, and cancels (a thread of
their own, in order).
"""
from __future__ import annotations

import json
import logging
import math
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from flashpd.engine.config import optional_file
from flashpd.cluster.detok import Detokenizer
from flashpd.cluster.chat_template import SPECIAL_TOKENS, ChatTemplate, ChatTemplateError, ChatTemplateTooLong
from flashpd.cluster.generation_server import MAX_CHARS_PER_TOKEN, POLL_S, Backend
from flashpd.decode_node.engine_loop import EngineStopped, Overloaded, coalesce
from flashpd.engine.kv_cache import blocks_needed
from flashpd.engine.scheduler import PromptTooLong, RequestFailed
from flashpd.engine.sampling import SEED_RANGE, TOP_K_MAX, SamplingParams

log = logging.getLogger(__name__)

SUBMIT_TIMEOUT_S = 60.0  # as the gRPC API without a client deadline: the backend must take the request by then
DISCONNECT_CHECK_S = 0.25  # how often a non-streamed request looks for its client between tokens
MAX_STOPS = 16
# Each stop string is searched for in the held-back text at every token, on the event loop that serves every
# stream: stops as long as the output made that quadratic (16 stops of 8k characters: 0.6 s at 16k tokens)
MAX_STOP_CHARS = 1024
TEMPLATE_OWN = ("messages", "add_generation_prompt", "continue_final_message", "tools", "documents", "max_chars")
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# fields flashpd cannot honour: refused (400) unless absent or at the value that means "off"
UNSUPPORTED = {
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "length_penalty": (None, 1), "logit_bias": (None, {}), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "prompt_logprobs": (None,), "echo": (None, False), "best_of": (None, 1), "use_beam_search": (None, False),
    "suffix": (None, ""), "min_tokens": (None, 0), "min_p": (None, 0), "stop_token_ids": (None, []),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,)}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s  # a Retry-After header: the server is busy, not gone

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _ErrorJSON(JSONResponse):
    """An error body in ASCII JSON: a message may quote a client's string, which may hold lone surrogates
    (valid in JSON input, not encodable as UTF-8)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _cap(s: str, n: int = 64) -> str:
    return s if len(s) <= n else s[:n] + f"...({len(s)} chars)"


def _show(v: Any) -> str:
    """A client's value in an error message: as JSON, capped."""
    try:
        return _cap(json.dumps(v))
    except (TypeError, ValueError):
        return _cap(repr(v))


def _bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, "invalid_request_error", param, code)


def _too_long(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "invalid_request_error", param, "context_length_exceeded")


def error_for(e: BaseException) -> APIError:
    """The HTTP error of a backend failure (the status its gRPC code maps to)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestFailed):  # this request alone failed while being served
        return APIError(500, str(e), "server_error", None, "internal_error")
    if isinstance(e, PromptTooLong):
        return APIError(400, f"prompt: {e}", "invalid_request_error", "prompt", "context_length_exceeded")
    if isinstance(e, TimeoutError):
        return APIError(504, str(e) or "timed out", "server_error", None, "timeout")
    if isinstance(e, ValueError):
        return APIError(400, str(e), "invalid_request_error", None, None)
    if isinstance(e, Overloaded):  # busy, not gone (gRPC: RESOURCE_EXHAUSTED): the client may retry shortly
        return APIError(503, str(e), "server_error", None, "service_unavailable", retry_after_s=1)
    msg = str(e) if isinstance(e, EngineStopped) else f"{type(e).__name__}: {e}"
    return APIError(503, msg, "server_error", None, "service_unavailable")


# each takes the value as a finite float (sampling_defaults checks that first)
_DEFAULT_OK = {"temperature": (lambda v: v >= 0, "a number >= 0"),
               "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
               "top_k": (lambda v: v.is_integer() and -1 <= v < 2 ** 31, "an integer in [-1, 2**31)")}


def sampling_defaults(model_dir: str | Path | None) -> dict:
    """temperature / top_p / top_k from the model's generation_config.json (vLLM's default), when set. One a request
    could not carry is a ValueError naming the file (the service refuses to start): taken as it was, every request
    that left the field unset was refused 400, blaming the client for the server's default."""
    if model_dir is None:
        return {}
    p = Path(model_dir) / "generation_config.json"
    there = optional_file(p, model_dir)  # a broken link: refused (CheckpointError), not a file to warn about
    try:
        cfg = json.loads(p.read_text()) if there else {}
    except (OSError, ValueError):
        log.warning("%s is unreadable; OpenAI's sampling defaults apply", p)
        return {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: must be a JSON object, got {_show(cfg)}")
    out = {}
    for k, (ok, want) in _DEFAULT_OK.items():
        v = cfg.get(k)
        if v is None:
            continue
        try:
            bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)) \
                or not ok(float(v))
        except OverflowError:  # an integer past float's range (10**400): no request could carry it either
            bad = True
        if bad:
            raise ValueError(f"{p}: {k} must be {want} (the HTTP API's default for requests that leave it unset), "
                             f"got {_show(v)}")
        out[k] = int(v) if k == "top_k" else v
    return out


# ---- request fields --------------------------------------------------------------------------------

def _int(body: dict, name: str, default: int | None, lo: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"must be an integer, got {_show(v)}")
    if lo is not None and v < lo:
        raise _bad(name, f"must be >= {lo}, got {_show(v)}")
    return v


def _finite(v: int | float) -> bool:
    """Whether v is a finite float: a JSON integer too large for a float is not (math.isfinite raises on it)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return float(default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
        raise _bad(name, f"must be a finite number, got {_show(v)}")
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"must be true or false, got {_show(v)}")
    return v


@dataclass
class _Req:
    """A parsed request: what the backend gets and what the response needs."""

    prompt: list[int]
    params: SamplingParams
    method: str
    draft_width: int | None
    stops: list[str]
    stream: bool
    include_usage: bool
    return_token_ids: bool


@dataclass
class _State:
    backend: Backend
    tokenizer: Any
    model_name: str
    metrics: Any
    chat: ChatTemplate | None
    chat_error: str | None
    defaults: dict
    limiter: anyio.CapacityLimiter
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # drain(): the server stops; requests in flight end now with a 503 / an error event

    def drain(self) -> None:
        """End every request in flight with OpenAI's error body (a stream: an error event, then [DONE]) and cancel
        it in the backend: called by http_server before its grace period runs out, when uvicorn would cancel the
        tasks (a bare 500, or a stream cut with no error event). Requests see it within POLL_S."""
        self.draining = True

    # ---- parsing ---------------------------------------------------------------------------------
    def check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is None:
            return
        if not isinstance(m, str):
            raise _bad("model", "must be a string")
        if m != self.model_name:
            raise APIError(404, f"The model {_show(m)} does not exist (this server serves `{self.model_name}`).",
                           "invalid_request_error", "model", "model_not_found")

    def encode(self, text: str, param: str) -> list[int]:
        limit = self.backend.max_positions
        if not text:
            raise _bad(param, "the prompt is empty")
        if self.tokenizer is None:
            raise _bad(param, "this server has no tokenizer; send token ids")
        if len(text) > limit * MAX_CHARS_PER_TOKEN:
            raise _too_long(param, f"{len(text)} characters cannot fit the model's {limit} positions")
        try:  # whatever the tokenizer refuses (a lone surrogate, ...) is the client's text
            over = self.tokenizer.tokens_over(text, limit)  # before encoding it whole: memory by tokens, not characters
            if over is None:
                ids = self.tokenizer.encode(text)  # on a worker thread (`request`), and without the interpreter lock
        except Exception as e:  # noqa: BLE001
            raise _bad(param, f"the tokenizer refused it ({_cap(str(e))})") from None
        if over is not None:
            raise _too_long(param, f"at least {over} tokens cannot fit the model's {limit} positions")
        if not ids:
            raise _bad(param, "the prompt encodes to no tokens")
        return ids

    def check_ids(self, ids: list, param: str) -> list[int]:
        if not ids:
            raise _bad(param, "the prompt is empty")
        vocab = self.backend.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise _bad(param, f"[{i}]: token id {_show(t)} is not in the vocabulary (size {vocab})")
        return list(ids)

    def completion_prompt(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            if len(p) != 1:
                raise _bad("prompt", f"one prompt per request (got {len(p)}); send several requests")
            p = p[0]
        if isinstance(p, str):
            return self.encode(p, "prompt")
        if isinstance(p, list):
            return self.check_ids(p, "prompt")
        raise _bad("prompt", "must be a string, a list of token ids, or a list of one of them")

    def chat_prompt(self, body: dict) -> list[int]:
        if self.chat is None:
            raise APIError(400, self.chat_error or "this model has no chat template (tokenizer_config.json "
                           "chat_template); use /v1/completions", "invalid_request_error", "messages",
                           "no_chat_template")
        if self.tokenizer is None:
            raise _bad("messages", "this server has no tokenizer")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages", "must be a non-empty list of messages")
        conv = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}]", "must be an object with a string 'role'")
            m = dict(m)
            c = m.get("content")
            if isinstance(c, list):  # content parts: the text ones, joined (a text-only model)
                texts = []
                for j, part in enumerate(c):
                    text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
                    if not isinstance(text, str):
                        raise _bad(f"messages[{i}].content[{j}]", "only text parts are supported")
                    texts.append(text)
                m["content"] = "\n".join(texts)
            elif c is not None and not isinstance(c, str):
                raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
            conv.append(m)
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):  # [], "", 0, false are not objects either
            raise _bad("chat_template_kwargs", "must be an object")
        for k in kwargs:
            if k in TEMPLATE_OWN:
                raise _bad(f"chat_template_kwargs.{k}", "is set by the server (from the request's own fields)")
            if k in SPECIAL_TOKENS or k == "additional_special_tokens":  # the tokenizer's, not a client's to replace
                raise _bad(f"chat_template_kwargs.{k}", "is the model's special token, not a template option")
        cont = _bool(body, "continue_final_message", False)
        limit = self.backend.max_positions * MAX_CHARS_PER_TOKEN
        try:
            text = self.chat.render(conv, add_generation_prompt=_bool(body, "add_generation_prompt", not cont),
                                    continue_final_message=cont, tools=None, documents=None, max_chars=limit,
                                    **kwargs)
        except ChatTemplateTooLong:
            raise _too_long("messages", f"the rendered prompt passed {limit} characters, more than the model's "
                                        f"{self.backend.max_positions} positions can hold") from None
        except ChatTemplateError as e:
            raise _bad("messages", _cap(str(e), 256)) from None
        return self.encode(text, "messages")

    def parse(self, body: dict, prompt: list[int], chat: bool) -> _Req:
        for name, offs in UNSUPPORTED.items():
            if name in body and body[name] not in offs:
                raise _bad(name, "is not supported by flashpd")
        lp = body.get("logprobs")
        if not chat and isinstance(lp, (int, float)) and not isinstance(lp, bool):  # (chat's is a bool: false is off)
            # completions' logprobs is a count of alternatives, and 0 still asks for the chosen tokens' logprobs
            raise _bad("logprobs", f"is not supported by flashpd (got {_show(lp)}; 0 still asks for the chosen tokens')")
        n = _int(body, "n", 1)
        if n != 1:
            raise _bad("n", f"only n=1 is supported, got {_show(n)}")
        be = self.backend
        limit = be.max_positions
        if len(prompt) >= limit:
            raise _too_long("prompt", f"{len(prompt)} tokens leave no room for output in the model's {limit} "
                            "positions")
        method = body.get("method")
        if method is None:
            method = "dflash" if be.has_drafter else "native"
        if method not in ("native", "dflash"):
            raise _bad("method", f"must be 'native' or 'dflash', got {_show(method)}")
        if method == "dflash" and not be.has_drafter:
            raise _bad("method", "'dflash' needs a server with a drafter")
        width = _int(body, "block_size", 0)  # the JSON field block_size is the DFlash draft width
        if method == "dflash" and width != 0 and not 2 <= width <= 16:
            raise _bad("block_size", f"must be in [2, 16] for dflash (0 = the drafter's default), got {_show(width)}")
        draft_width = width if method == "dflash" and width else None
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int(body, name, None, lo=1)
        if max_tokens is None:
            max_tokens = COMPLETIONS_MAX_TOKENS if not chat else self._room(len(prompt), method, draft_width)
        if len(prompt) + max_tokens > limit:
            raise _too_long(name, f"{_show(max_tokens)} with the prompt's {len(prompt)} tokens exceeds the model's "
                            f"{limit} positions")
        temperature = _num(body, "temperature", self.defaults.get("temperature", 1.0))
        if temperature < 0:
            raise _bad("temperature", f"must be >= 0 (below 1e-5: greedy), got {_show(temperature)}")
        top_p = _num(body, "top_p", self.defaults.get("top_p", 1.0))
        if not 0 < top_p <= 1:
            raise _bad("top_p", f"must be in (0, 1], got {_show(top_p)}")
        top_k = _int(body, "top_k", int(self.defaults.get("top_k", 0)))
        if top_k == -1:  # vLLM's "off"
            top_k = 0
        if not 0 <= top_k <= TOP_K_MAX:
            raise _bad("top_k", f"must be in [0, 2**31 - 1] (0 or -1: off), got {_show(top_k)}")
        seed = _int(body, "seed", None)
        if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise _bad("seed", "must be in [-2**63, 2**64)")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
            raise _bad("stop", f"must be a string or a list of at most {MAX_STOPS} strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise _bad("stop", f"each stop string may have at most {MAX_STOP_CHARS} characters")
        stops = [s for s in stops if s]
        if stops and self.tokenizer is None:
            raise _bad("stop", "stop strings need a server with a tokenizer")
        stream = _bool(body, "stream", False)
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise _bad("stream_options", "must be an object")
        if so is not None and not stream:  # as OpenAI and vLLM: usage asked for in a stream that is not one
            raise _bad("stream_options", "is only allowed when stream is true")
        include_usage = _bool(so or {}, "include_usage", False)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                ignore_eos=_bool(body, "ignore_eos", False))
        return _Req(prompt, params, method, draft_width, stops, stream, include_usage,
                    _bool(body, "return_token_ids", False))

    def _room(self, prompt_len: int, method: str, draft_width: int | None) -> int:
        """Chat's default max_tokens: what the context and one worker's whole KV cache leave. A backend that is not
        serving has no KV figures to bound it by: 503 (retry later, or name max_tokens), not an unbounded default
        the engine would then refuse as the client's prompt error."""
        be = self.backend
        room = be.max_positions - prompt_len
        c = be.counts()
        if c.serving is False or not be.alive:
            raise APIError(503, "the server is not serving now, so chat's default max_tokens (what the KV cache "
                           "leaves) cannot be worked out: retry later, or set max_tokens",
                           "server_error", None, "service_unavailable")
        total, bs = c.kv_blocks_total, c.kv_block_size
        if total and bs:
            width = (draft_width or be.default_draft_width or 1) if method == "dflash" else 1
            if room > 0 and blocks_needed(prompt_len, room, width, bs) > total:
                room = total * bs - prompt_len - width  # then exactly `total` blocks
        if room < 1:
            raise _too_long("messages", f"the prompt's {prompt_len} tokens leave no room for output")
        return room

    async def request(self, body: dict, chat: bool) -> _Req:
        """The parsed request, made on a worker thread: tokenizing a long prompt, rendering a chat template and
        chat's default max_tokens (backend.counts(): a round trip to an engine process, up to seconds when it is
        stuck) would otherwise stop the event loop, and with it every stream and request."""
        def parse() -> _Req:
            return self.parse(body, self.chat_prompt(body) if chat else self.completion_prompt(body), chat)

        return await anyio.to_thread.run_sync(parse, limiter=self.limiter)

    # ---- running -----------------------------------------------------------------------------------
    async def submit(self, r: _Req):
        fn = partial(self.backend.submit, r.prompt, r.params, r.method, r.draft_width, timeout_s=SUBMIT_TIMEOUT_S)
        try:
            with anyio.CancelScope(shield=True):  # a handle, once made, always reaches the caller's finally
                return await anyio.to_thread.run_sync(fn, limiter=self.limiter)
        except PromptTooLong as e:  # the prompt's fault, or max_tokens' when the prompt alone fits: the param says
            param = await anyio.to_thread.run_sync(self._too_long_param, r, limiter=self.limiter)
            raise APIError(400, f"{param}: {e}", "invalid_request_error", param, "context_length_exceeded") from None
        except Exception as e:  # noqa: BLE001  each failure gets its status; none escapes as a bare 500
            raise error_for(e) from None

    def _too_long_param(self, r: _Req) -> str:
        """"max_tokens" when the prompt alone leaves room for output in the context and one worker's KV cache (so
        max_tokens is what cannot fit), else "prompt" (also when that cannot be worked out now)."""
        try:
            return "max_tokens" if self._room(len(r.prompt), r.method, r.draft_width) >= 1 else "prompt"
        except Exception:  # noqa: BLE001  no room at all, or no KV figures to tell by
            return "prompt"

    async def run_once(self, r: _Req, request: Request) -> tuple[str, list[int], str, dict]:
        """A non-streamed request: (text, tokens, finish_reason, flashpd stats)."""
        run = _Run(self, r, await self.submit(r), request)
        parts, toks = [], []
        try:
            async for p in run.pieces():
                parts.append(p.text)
                toks.extend(p.tokens)
                if p.finish_reason is not None:
                    text = "".join(parts)
                    if not r.stops and self.tokenizer is not None:
                        text = self.tokenizer.decode(toks)  # exactly the gRPC API's text
                    return text, toks, p.finish_reason, p.stats
        finally:
            run.close()
        raise APIError(499, "client disconnected")  # nobody reads this

    async def start_stream(self, r: _Req, request: Request) -> tuple["_Run", AsyncIterator["_Piece"]] | None:
        """Submit and wait for the first piece, so that failures so far get their HTTP status; returns the
        run and its pieces, the first one included (None: the client left meanwhile)."""
        run = _Run(self, r, await self.submit(r), request)
        it = run.pieces()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return None
        except BaseException:
            run.close()
            raise
        run.request = None  # from here the response listens for the disconnect (and cancels the stream)
        return run, _prepend(first, it)


_cancels: queue.SimpleQueue = queue.SimpleQueue()
_canceller: threading.Thread | None = None
_canceller_lock = threading.Lock()


def _cancel_soon(backend: Backend, h) -> None:
    """backend.cancel(h) on a thread of its own, at once and in order: close() runs on the event loop, and a cancel
    can block (engine_proc's pipe to an engine process that is stuck fills up, and its writes have no deadline): on
    the loop, one client leaving then froze every request and /health until the engine came back."""
    global _canceller
    with _canceller_lock:
        if _canceller is None or not _canceller.is_alive():
            _canceller = threading.Thread(target=_cancel_forever, name="http-api-cancel", daemon=True)
            _canceller.start()
    _cancels.put((backend, h))


def _cancel_forever() -> None:
    while True:
        backend, h = _cancels.get()
        try:
            backend.cancel(h)
        except Exception:  # noqa: BLE001  this thread serves every request's cancel: it must go on
            log.exception("cancelling a request in the backend failed")


class _Run:
    """One request in the backend: its pieces of output, and close() to cancel it unless it finished."""

    def __init__(self, st: _State, r: _Req, h, request: Request | None) -> None:
        self.st, self.r, self.h = st, r, h
        self.request = request  # polled for a disconnect while set
        self.done = False

    def close(self) -> None:
        """Drop the request in the backend (its KV blocks freed) unless it ran to its end."""
        if not self.done:
            self.done = True
            _cancel_soon(self.st.backend, self.h)

    async def pieces(self) -> AsyncIterator["_Piece"]:
        """The output as pieces (new text and tokens), the last one with finish_reason and stats; ends
        without one when the polled client left. However it ends before its last piece, close() runs."""
        st, r, h = self.st, self.r, self.h
        be = st.backend
        text = _Text(st.tokenizer, r.stops)
        t0 = time.perf_counter()
        ttft = None
        last_check = time.monotonic()
        pending = None  # an event met after token events merged into one (engine_loop.coalesce), to go next
        try:
            while True:
                ev, pending = (pending, None) if pending is not None else (h.get(0), None)
                if ev is None:
                    ev = await anyio.to_thread.run_sync(h.get, POLL_S, limiter=st.limiter)
                if ev is not None and ev.kind == "tokens":
                    ev, pending = coalesce(h, ev)
                final = pending if ev is not None and ev.kind == "tokens" else ev
                if st.draining and (final is None or final.kind == "tokens") and not _end_queued(h):
                    # (a request whose end is already queued, however many tokens before it, is served whole)
                    raise APIError(503, "the server is shutting down", "server_error", None, "service_unavailable")
                if self.request is not None and (ev is None or time.monotonic() - last_check > DISCONNECT_CHECK_S):
                    last_check = time.monotonic()
                    if await self.request.is_disconnected():
                        return
                if ev is None:
                    if not be.alive:
                        raise APIError(503, "engine loop stopped", "server_error", None, "service_unavailable")
                    continue
                if ev.kind == "tokens":
                    if ttft is None:
                        ttft = (time.perf_counter() - t0) * 1e3
                    new, used, stopped = text.push(ev.tokens)
                    if stopped:
                        self.close()  # the text is complete: the backend stops generating now
                        if ev.sent is not None:
                            ev.sent.set()
                        stats = {"ttft_ms": ttft, "latency_ms": (time.perf_counter() - t0) * 1e3}
                        yield _Piece(new, ev.tokens[:used], "stop", _stats(r.method, stats))
                        return
                    yield _Piece(new, ev.tokens)
                    if ev.sent is not None:  # resumed: the piece is with the client's transport
                        ev.sent.set()
                elif ev.kind == "done":
                    self.done = True
                    new, stopped = text.finish()
                    reason = "stop" if stopped else (ev.finish_reason or "stop")
                    yield _Piece(new, [], reason, _stats(r.method, ev.stats or {}))
                    return
                elif ev.kind == "error":
                    raise error_for(ev.error)
                else:  # "cancelled": only a cancel of ours, or the server going away
                    raise APIError(503, "request cancelled", "server_error", None, "service_unavailable")
        finally:
            self.close()


def _end_queued(h) -> bool:
    """Whether h's queue already holds its request's last event (anything but tokens): a look, nothing taken."""
    q = getattr(h, "events", None)
    mutex, items = getattr(q, "mutex", None), getattr(q, "queue", None)
    if mutex is None or items is None:
        return False
    with mutex:
        return any(e is not None and e.kind != "tokens" for e in items)


@dataclass
class _Piece:
    text: str
    tokens: list[int]
    finish_reason: str | None = None
    stats: dict | None = None


async def _prepend(first, it):
    try:
        yield first
        async for p in it:
            yield p
    finally:
        await it.aclose()


def _stats(method: str, s: dict) -> dict:
    return {"method": method, "tau": s.get("tau"), "acceptance_lengths": s.get("acceptance_lengths"),
            "ttft_ms": s.get("ttft_ms"), "prefill_ms": s.get("prefill_ms"), "latency_ms": s.get("latency_ms")}


class _Text:
    """Incremental detokenization with stop strings: the window decode of cluster/detok.py (the gRPC API's too,
    so the pieces add up to its text), and the last (longest stop - 1) characters held back until it is clear they
    do not start a stop string."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tok = tokenizer
        self.detok = Detokenizer(tokenizer)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""  # decoded, not yet handed out

    def _decode(self, toks: list[int]) -> str:
        return self.detok.push(toks)

    def _add(self, new: str, final: bool = False) -> tuple[str, bool]:
        """Take new text: (what can be handed out now, whether a stop string ended the text). final: the text
        ends here, so nothing is held back (a stop string may still begin in what was held)."""
        old = len(self.pending)
        self.pending += new
        if self.stops:  # a stop not found before can only end in the new text: each search starts len(stop) - 1 back
            # (not `hold` back: with one long stop, every stop then searched all the text held so far, at each token)
            hits = [i for s in self.stops if (i := self.pending.find(s, max(0, old - len(s) + 1))) >= 0]
            if hits:
                out, self.pending = self.pending[:min(hits)], ""
                return out, True
        cut = len(self.pending) - (0 if final else self.hold)
        if cut <= 0:
            return "", False
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def push(self, toks: list[int]) -> tuple[str, int, bool]:
        """(text to hand out, how many of toks count, whether a stop string ended the text)."""
        if self.tok is None:
            return "", len(toks), False
        if not self.stops:
            return self._add(self._decode(toks))[0], len(toks), False
        out = []
        for i, t in enumerate(toks):  # one at a time: the token that completes a stop is the last counted
            s, stopped = self._add(self._decode([t]))
            out.append(s)
            if stopped:
                return "".join(out), i + 1, True
        return "".join(out), len(toks), False

    def finish(self) -> tuple[str, bool]:
        """The rest of the text once the backend finished: (text, whether a stop string ended it)."""
        if self.tok is None:
            return "", False
        return self._add(self.detok.finish(), final=True)


# ---- responses ---------------------------------------------------------------------------------------

def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _check_shape(raw: bytes, max_values: int) -> None:
    """Refuse a body of more JSON values than a request can use, before parsing it. Parsing runs on the event loop
    and holds the GIL (a worker thread would not free the loop): 13 MiB of small objects took 2 s, in which every
    stream and /health waited. Counted over the raw bytes at about 1 ms a MiB; a UTF-8 body over a bound by that
    count (strings' commas and brackets count too) is counted again outside its strings (`_outside_strings`), so
    text full of brackets is not refused for them. Containers are bounded by the max_values // 2 values a request of
    max_positions tokens needs, values by max_values; a body within both parses in tens of ms at most."""
    containers, values = _separators(raw)
    if containers > max_values // 2 or values > max_values:
        outside = _outside_strings(raw, max_values + max_values // 2 + 1)
        if outside is not None:
            containers, values = _separators(outside)
    if containers > max_values // 2 or values > max_values:
        raise APIError(413, f"the request body holds too many JSON values ({values} separators, {containers} "
                            f"objects and arrays; at most {max_values} and {max_values // 2})",
                       "invalid_request_error", None, "request_too_large")


def _separators(raw: bytes) -> tuple[int, int]:
    """(objects and arrays opened, commas and colons) in raw."""
    return raw.count(b"{") + raw.count(b"["), raw.count(b",") + raw.count(b":")


_STRING = re.compile(rb'"[^"]*"')  # a string once its escaped quotes are blanked: linear, nothing to backtrack


def _outside_strings(raw: bytes, max_strings: int) -> bytes | None:
    """raw with its JSON strings emptied, or None where the raw count must stand: a body json.loads would not read as
    UTF-8 (it guesses UTF-16 and UTF-32 from NUL bytes, where a quote byte need not be a quote), or one of more
    strings than max_strings (each string is a key before a colon, a value after a comma, or a container's or the
    body's first value, so a body within the bounds holds at most values + containers + 1). Escaped backslashes,
    then escaped quotes, are blanked first, so every quote left delimits a string as the parser reads it, up to the
    first error it would stop at; an unterminated string is left in (counted: never an undercount). A few linear
    passes of bytes methods and one regex (a pattern over escapes would backtrack)."""
    if json.detect_encoding(raw) not in ("utf-8", "utf-8-sig"):
        return None
    plain = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    if plain.count(b'"') > 2 * max_strings:
        return None
    return _STRING.sub(b'""', plain)


async def _read_json(request: Request, limit: int, max_values: int) -> dict:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError(413, f"the request body is over {limit} bytes", "invalid_request_error", None,
                       "request_too_large")
    chunks, n = [], 0
    try:
        async for c in request.stream():
            n += len(c)
            if n > limit:
                raise APIError(413, f"the request body is over {limit} bytes", "invalid_request_error", None,
                               "request_too_large")
            chunks.append(c)
    except ClientDisconnect:  # gone before its body came whole (or cut off by http_guard's deadline): no server
        # failure, so no traceback in the log (two each, for any client who likes), and nobody to answer
        raise APIError(499, "the client disconnected while sending its request", "invalid_request_error") from None
    raw = b"".join(chunks)
    _check_shape(raw, max_values)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise _bad(None, f"the body is not valid JSON: {_cap(str(e))}") from None
    if not isinstance(body, dict):
        raise _bad(None, "the body must be a JSON object")
    return body


def build_app(backend: Backend, tokenizer, model_name: str, metrics=None, chat_template: ChatTemplate | None = None,
              chat_error: str | None = None, defaults: dict | None = None, max_concurrent: int = 256,
              settings: dict | None = None) -> FastAPI:
    """The HTTP API over `backend` (see the module's doc). tokenizer: engine/tokenizer.TextTokenizer or None;
    metrics: cluster/metrics.Metrics whose registry /metrics exposes (None: 404); chat_template: the target's
    (None: chat requests get 400, with chat_error as the reason when given); defaults: sampling defaults
    (sampling_defaults(target)); max_concurrent: the config's bound on concurrent requests (the worker threads
    that wait on the backend are bounded by twice that, as http_server bounds connections and requests);
    settings: what /health reports of how the service runs (ServeConfig.public_settings, as gRPC Health does)."""
    st = _State(backend, tokenizer, model_name, metrics, chat_template, chat_error, dict(defaults or {}),
                anyio.CapacityLimiter(2 * max_concurrent))
    body_limit = max(1 << 20, backend.max_positions * MAX_CHARS_PER_TOKEN * 2)
    max_values = 2 * backend.max_positions + (1 << 16)  # a prompt as ids is max_positions values; room for the rest
    app = FastAPI(title="flashpd", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.flashpd = st
    app.state.drain = st.drain  # http_server.HttpServer.stop()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
        return _ErrorJSON(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        typ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _ErrorJSON(APIError(e.status_code, str(e.detail), typ).body(), status_code=e.status_code,
                          headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        # a server bug: its text (paths, internals) stays in the log; the client gets an id to find it there
        error_id = uuid.uuid4().hex[:12]
        log.exception("HTTP API request failed (error id %s)", error_id)
        return _ErrorJSON(APIError(500, f"internal server error (error id {error_id}: the server's log has the "
                                        "details)", "server_error", None, "internal_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        # may wait on an engine process; anyio's own threads, so a probe never queues behind requests' threads
        c = await anyio.to_thread.run_sync(backend.counts)
        serving = (backend.alive if c.serving is None else c.serving) and backend.alive
        return JSONResponse({"status": "ok" if serving else "unavailable", **c.as_dict(), "settings": settings},
                            status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics_():
        if metrics is None:
            raise APIError(404, "this server has no metrics", "not_found_error")
        from prometheus_client import CONTENT_TYPE_LATEST  # noqa: PLC0415

        # live families read the backend (engine-process round trips, seconds each when it is stuck): off the loop
        text = await anyio.to_thread.run_sync(metrics.exposition)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    def _model_card() -> dict:
        return {"id": model_name, "object": "model", "created": st.created, "owned_by": "flashpd",
                "root": model_name, "parent": None, "max_model_len": backend.max_positions}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != model_name:
            raise APIError(404, f"The model {_show(model)} does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        return _model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _read_json(request, body_limit, max_values)
        st.check_model(body)
        r = await st.request(body, chat=False)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}

        def choice(text: str, toks: list[int], reason: str | None) -> dict:
            c = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            if r.return_token_ids:
                c["token_ids"] = toks
            return c

        if not r.stream:
            text, toks, reason, stats = await st.run_once(r, request)
            out = {**head, "choices": [choice(text, toks, reason)], "usage": _usage(len(r.prompt), len(toks)),
                   "flashpd": stats}
            if r.return_token_ids:
                out["prompt_token_ids"] = r.prompt
            return JSONResponse(out)

        started = await st.start_stream(r, request)
        if started is None:
            return Response(status_code=499)
        run, pieces = started

        async def events():
            n = 0
            try:
                async for p in pieces:
                    n += len(p.tokens)
                    if p.finish_reason is None:
                        if p.text or r.return_token_ids:
                            yield _sse({**head, "choices": [choice(p.text, p.tokens, None)]})
                        continue
                    yield _sse({**head, "choices": [choice(p.text, p.tokens, p.finish_reason)], "flashpd": p.stats})
                    if r.include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(len(r.prompt), n)})
            except APIError as e:
                yield _sse(e.body())
            yield _sse("[DONE]")

        return _EventStream(events(), run.close)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _read_json(request, body_limit, max_values)
        st.check_model(body)
        r = await st.request(body, chat=True)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}

        if not r.stream:
            text, toks, reason, stats = await st.run_once(r, request)
            c = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                 "finish_reason": reason}
            if r.return_token_ids:
                c["token_ids"] = toks
            out = {**head, "choices": [c], "usage": _usage(len(r.prompt), len(toks)), "flashpd": stats}
            if r.return_token_ids:
                out["prompt_token_ids"] = r.prompt
            return JSONResponse(out)

        started = await st.start_stream(r, request)
        if started is None:
            return Response(status_code=499)
        run, pieces = started
        head = {**head, "object": "chat.completion.chunk"}

        def chunk(delta: dict, toks: list[int], reason: str | None) -> dict:
            c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            if r.return_token_ids:
                c["token_ids"] = toks
            return {**head, "choices": [c]}

        async def events():
            n = 0
            yield _sse(chunk({"role": "assistant", "content": ""}, [], None))
            try:
                async for p in pieces:
                    n += len(p.tokens)
                    if p.finish_reason is None:
                        if p.text or r.return_token_ids:
                            yield _sse(chunk({"content": p.text}, p.tokens, None))
                        continue
                    if p.text:
                        yield _sse(chunk({"content": p.text}, p.tokens, None))
                    yield _sse({**chunk({}, [] if p.text else p.tokens, p.finish_reason), "flashpd": p.stats})
                    if r.include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(len(r.prompt), n)})
            except APIError as e:
                yield _sse(e.body())
            yield _sse("[DONE]")

        return _EventStream(events(), run.close)

    return app


class _EventStream(StreamingResponse):
    """Server-sent events; on_close runs however the response ends (the client left: the stream task was
    cancelled, maybe while the body's generator waited on the transport and so was never closed)."""

    def __init__(self, content, on_close) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

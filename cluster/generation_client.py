"""Client of the generation service: every call carries a deadline, and gRPC failures become
Python exceptions that say what went wrong (the server's message names the bad field)."""
from __future__ import annotations

import json
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Iterator

import grpc

from flashpd.cluster.api_key import grpc_metadata, key_from_env
from flashpd.cluster.config import MAX_WAIT_S
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc

_FLOAT32_LARGEST = 3.4028234663852886e38  # float32's largest finite value
TOP_P_MIN = 1.1754943508222875e-38  # engine/sampling.TOP_P_MIN (float32's smallest normal; no torch imported here)


def _real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)

PROTOCOL_VERSION = 1
MAX_TIMEOUT_S = MAX_WAIT_S  # a longer deadline overflows in gRPC ("deadline of 1e+30 s exceeded" at once)


def check_timeout(timeout_s: object, name: str = "timeout_s") -> float:
    """timeout_s as a deadline gRPC can keep: a number in (0, MAX_TIMEOUT_S], else ValueError naming it (0, a
    negative one or NaN reached the server and came back DEADLINE_EXCEEDED)."""
    if not (_real(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"{name}: must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got {timeout_s!r}")
    return float(timeout_s)


def check_address(address: str) -> str:
    """host:port with a port gRPC can dial: a port past 65535 was dialed modulo 65536, another server's perhaps."""
    host, sep, port = address.rpartition(":")
    if sep and host and port.isdigit() and not 0 < int(port) <= 65535:
        raise ValueError(f"address {address!r}: port {port} is not in [1, 65535]")
    return address


class GenerationError(Exception):
    """A generation call failed; `call` names it, `code` is the gRPC status (None for client-side checks)."""

    def __init__(self, call: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"Generation.{call}: {message}")
        self.call = call
        self.code = code


def _settings(raw: str) -> dict | None:
    """Health's settings_json -> the service's serving knobs, None when it reports none (an older server, or a
    worker's own Health); a reply that is not a JSON object is the server's fault, named as such."""
    if not raw:
        return None
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise GenerationError("Health", f"settings_json is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise GenerationError("Health", f"settings_json is a {type(d).__name__}, not an object")
    return d


class GenerationInvalidArgument(GenerationError, ValueError):
    """INVALID_ARGUMENT: the message names the field."""


class GenerationResourceExhausted(GenerationError):
    """RESOURCE_EXHAUSTED: the prompt (plus max_tokens) cannot fit this server."""


class GenerationFailedPrecondition(GenerationError):
    """FAILED_PRECONDITION: e.g. method 'dflash' on a server without a drafter."""


class GenerationTimeout(GenerationError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's deadline passed."""


class GenerationUnavailable(GenerationError, ConnectionError):
    """UNAVAILABLE: the server could not be reached or its engine stopped."""


class GenerationCancelled(GenerationError):
    """CANCELLED: the call was cancelled."""


class GenerationUnauthenticated(GenerationError, PermissionError):
    """UNAUTHENTICATED: the server asks for an API key (its api_key_file) and the call carried none or another."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: GenerationInvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: GenerationResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: GenerationFailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: GenerationTimeout,
    grpc.StatusCode.UNAVAILABLE: GenerationUnavailable,
    grpc.StatusCode.CANCELLED: GenerationCancelled,
    grpc.StatusCode.UNAUTHENTICATED: GenerationUnauthenticated,
}


def _map_error(call: str, e: grpc.RpcError, timeout_s: float) -> GenerationError:
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(code)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        details = f"deadline of {timeout_s:g} s exceeded ({details})"
    cls = _BY_CODE.get(code, GenerationError)
    return cls(call, details if cls is not GenerationError else f"{code.name if code else 'error'}: {details}", code)


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stats: dict | None = None


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict = field(default_factory=dict)


def stats_dict(s: pb.Stats) -> dict:
    return {"acceptance_lengths": list(s.acceptance_lengths), "tau": s.tau or None,
            "ttft_ms": s.ttft_ms, "latency_ms": s.latency_ms, "prefill_ms": s.prefill_ms or None}


def build_request(prompt: str | list[int], max_tokens: int = 64, method: str = "", block_size: int = 0,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                  ignore_eos: bool = False) -> pb.GenerateRequest:
    """A GenerateRequest; the keywords are its fields (block_size: the DFlash draft width, 0 = the drafter's;
    seed: any value SamplingParams takes, negative ones included). A value the wire cannot carry (a float token
    id, a negative block_size, text that is not UTF-8) raises ValueError naming the field: the client refuses it
    rather than truncate it or let protobuf's own error through."""
    req = pb.GenerateRequest(version=PROTOCOL_VERSION)
    if _real(temperature) and _FLOAT32_LARGEST < temperature < math.inf:
        # the field is float32: a finite temperature past its range (a float or an int) samples as the largest
        # (SamplingParams' rule), not as an infinity the server must refuse
        temperature = _FLOAT32_LARGEST
    if _real(top_p) and top_p == 0:  # 0 reads as unset on the wire (no filtering at all); the server checks the rest
        raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
    if _real(top_p) and 0 < top_p < TOP_P_MIN:
        # below float32's smallest normal a top_p would reach the server as a denormal or as 0, and 0 reads as
        # unset (1.0: no filtering at all); SamplingParams raises it to TOP_P_MIN, and so does the client
        top_p = TOP_P_MIN
    fields = dict(max_tokens=max_tokens, method=method, block_size=block_size, temperature=temperature,
                  top_p=top_p, top_k=top_k, ignore_eos=ignore_eos)
    for name, value in fields.items():
        try:
            setattr(req, name, value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}={value!r} cannot be sent: {e}") from None
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"prompt_text is not valid UTF-8: {e}") from None
        req.prompt_text = prompt
    else:
        try:
            ids = [operator.index(t) for t in prompt]
        except TypeError as e:
            raise ValueError(f"prompt_ids must be a list of integers: {e}") from None
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < 1 << 32), None)
        if bad is not None:
            raise ValueError(f"prompt_ids[{bad}]={ids[bad]} is not a token id")
        req.prompt_ids.ids.extend(ids)
        req.prompt_ids.SetInParent()  # an empty id list is still "prompt_ids" (the server names it)
    if seed is not None:
        try:
            req.seed = operator.index(seed) % (1 << 64)  # the wire's uint64; draws are keyed by the seed mod 2**64
        except TypeError:
            raise ValueError(f"seed={seed!r} must be an integer") from None
    return req


class GenerationClient:
    """One channel to one generation server. Thread-safe (gRPC channels are); close() when done.
    api_key: the server's key (its api_key_file's content), sent with every call as `authorization: Bearer`;
    None: FLASHPD_API_KEY's, if set (cluster/api_key.py)."""

    def __init__(self, address: str, timeout_s: float = 60.0, api_key: str | None = None) -> None:
        self.address = check_address(address)
        self.timeout_s = check_timeout(timeout_s)
        self._metadata = grpc_metadata(api_key if api_key is not None else key_from_env())
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def _request(self, call: str, prompt: str | list[int], kw: dict) -> pb.GenerateRequest:
        """The request, or GenerationInvalidArgument (a ValueError) naming the field the wire cannot carry."""
        self._check_open(call)
        try:
            return build_request(prompt, **kw)
        except ValueError as e:
            raise GenerationInvalidArgument(call, str(e)) from None

    def _check_open(self, call: str) -> None:
        if self._closed:  # grpc's own error here is a bare ValueError about a closed channel
            raise GenerationError(call, f"this client of {self.address} was closed")

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_version(self, call: str, version: int) -> None:
        if version != PROTOCOL_VERSION:
            raise GenerationError(call, f"reply version {version}, expected {PROTOCOL_VERSION}")

    def generate(self, prompt: str | list[int], timeout_s: float | None = None, **kw) -> Iterator[Chunk]:
        """Stream the chunks of one request (kw: max_tokens, method, block_size, temperature, top_p,
        top_k, seed, ignore_eos). Closing the iterator early cancels the request on the server."""
        t = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        call = self._stub.Generate(self._request("Generate", prompt, kw), timeout=t, metadata=self._metadata)
        try:
            for msg in call:
                self._check_version("Generate", msg.version)
                yield Chunk(list(msg.token_ids), msg.text, msg.finished, msg.finish_reason or None,
                            stats_dict(msg.stats) if msg.finished else None)
        except grpc.RpcError as e:
            raise _map_error("Generate", e, t) from None
        finally:
            call.cancel()  # no-op once the stream is complete

    def generate_once(self, prompt: str | list[int], timeout_s: float | None = None, **kw) -> Result:
        t = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        try:
            r = self._stub.GenerateOnce(self._request("GenerateOnce", prompt, kw), timeout=t,
                                        metadata=self._metadata)
        except grpc.RpcError as e:
            raise _map_error("GenerateOnce", e, t) from None
        self._check_version("GenerateOnce", r.version)
        return Result(list(r.token_ids), r.text, r.finish_reason, stats_dict(r.stats))

    def health(self, timeout_s: float | None = None) -> dict:
        t = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        self._check_open("Health")
        try:
            r = self._stub.Health(pb.HealthRequest(version=PROTOCOL_VERSION), timeout=t, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _map_error("Health", e, t) from None
        self._check_version("Health", r.version)
        return {"serving": r.serving, "has_drafter": r.has_drafter, "has_tokenizer": r.has_tokenizer,
                "running": r.running, "waiting": r.waiting, "kv_blocks_free": r.kv_blocks_free,
                "kv_blocks_total": r.kv_blocks_total, "kv_block_size": r.kv_block_size, "vocab_size": r.vocab_size,
                "max_positions": r.max_positions, "default_block_size": r.default_block_size or None,
                "settings": _settings(r.settings_json)}

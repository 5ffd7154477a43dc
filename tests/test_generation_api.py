"""The generation gRPC API over a real server on 127.0.0.1: streamed == once == solo runs, 32
concurrent streams, status codes per field, cancel and deadline free the KV, health, drift."""
from __future__ import annotations

import filecmp
import threading
import time

import grpc
import pytest
import torch

from flashpd.decode_node.engine_loop import EngineLoop
from flashpd.cluster.generation_client import (GenerationClient, GenerationError, GenerationFailedPrecondition,
                                               GenerationInvalidArgument, GenerationResourceExhausted,
                                               GenerationTimeout, build_request)
from flashpd.cluster.generation_server import serve_generation
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc
from flashpd.decode_node.scheduler import Scheduler
from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.engine.scheduler import generate

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)
from tests._cluster_helpers import stream_chunks
from tests._serve_process import serve_process

NUM_BLOCKS = 512
WAIT_S = 20.0  # bound on every poll in this module


@pytest.fixture(scope="module")
def pair(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    return target, load_drafter(dflash_pair.draft_dir, target)


class _Served:
    def __init__(self, runner: ModelRunner, drafter) -> None:
        self.runner = runner
        self.sched = Scheduler(runner, drafter)
        self.free0 = runner.allocator.num_free
        self.loop = EngineLoop(self.sched)
        self.server, self.port = serve_generation(self.loop)
        self.address = f"127.0.0.1:{self.port}"
        self.client = GenerationClient(self.address, timeout_s=60.0)

    def close(self) -> None:
        self.client.close()
        self.server.stop(grace=None).wait(10)
        self.loop.stop(10)

    def wait_freed(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if self.runner.allocator.num_free == self.free0 and self.sched.idle:
                return
            time.sleep(0.02)
        raise AssertionError(f"KV not freed: {self.runner.allocator.num_free} free of {self.free0}, "
                             f"idle={self.sched.idle}")


@pytest.fixture(scope="module")
def served(pair):
    target, drafter = pair
    s = _Served(ModelRunner(target, NUM_BLOCKS, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter)
    yield s
    s.close()


@pytest.fixture(scope="module")
def small_native(pair):
    """No drafter and only 8 KV blocks (128 tokens): for FAILED_PRECONDITION and PromptTooLong."""
    target, _ = pair
    s = _Served(ModelRunner(target, 8, 16), None)
    yield s
    s.close()


@pytest.fixture(scope="module")
def solo(pair):
    target, drafter = pair
    runner = ModelRunner(target, 256, 16, taps=tuple(drafter.cfg.target_layer_ids))
    gens = {"native": NativeGenerator(runner), "dflash": DFlashGenerator(runner, drafter, ())}

    def run(prompt, max_tokens, method):
        s = generate(gens[method], [prompt], [SamplingParams(max_tokens=max_tokens, ignore_eos=True)])[0]
        return s.output, s.stats.acceptance_lengths
    return run


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 126, (int(k),), generator=g).tolist() for k in torch.randint(3, 120, (n,), generator=g)]



@pytest.mark.parametrize("method", ["dflash", "native"])
def test_stream_equals_once_equals_solo(served, solo, method):
    for prompt in _prompts(3, 7):
        toks, last = stream_chunks(served.client, prompt, max_tokens=40, method=method, ignore_eos=True)
        once = served.client.generate_once(prompt, max_tokens=40, method=method, ignore_eos=True)
        out, acc = solo(prompt, 40, method)
        assert toks == once.token_ids == out
        assert last.finish_reason == once.finish_reason == "length"
        assert last.stats["acceptance_lengths"] == once.stats["acceptance_lengths"] == acc
        if method == "dflash":
            assert sum(acc) == len(out) - 1 and last.stats["tau"] == pytest.approx(sum(acc) / len(acc))
        assert last.stats["latency_ms"] > 0 and last.stats["ttft_ms"] > 0
    served.wait_freed()


def test_default_method_is_dflash_with_a_drafter(served, solo):
    prompt = _prompts(1, 3)[0]
    r = served.client.generate_once(prompt, max_tokens=20, ignore_eos=True)
    out, acc = solo(prompt, 20, "dflash")
    assert r.token_ids == out and r.stats["acceptance_lengths"] == acc and acc


def test_32_concurrent_streams_exact(served, solo):
    prompts = _prompts(32, 11)
    methods = ["dflash" if i % 3 else "native" for i in range(32)]
    lens = [16 + i % 9 for i in range(32)]
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(32, timeout=WAIT_S)

    def worker(i):
        try:
            start.wait()
            results[i] = stream_chunks(served.client, prompts[i], max_tokens=lens[i], method=methods[i], ignore_eos=True)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors[:3]
    for i in range(32):
        toks, last = results[i]
        out, acc = solo(prompts[i], lens[i], methods[i])
        assert toks == out, i
        assert last.stats["acceptance_lengths"] == acc, i
    served.wait_freed()


def _code(fn):
    with pytest.raises(Exception) as ei:
        fn()
    return ei.value


@pytest.mark.parametrize("kw, field", [
    (dict(prompt=[]), "prompt_ids"),
    (dict(prompt=""), "prompt_text"),
    (dict(prompt=[1, 2], max_tokens=0), "max_tokens"),
    (dict(prompt=[1, 2], max_tokens=-3), "max_tokens"),
    (dict(prompt=[1, 2], method="beam"), "method"),
    (dict(prompt=[1, 2], method="dflash", block_size=1), "block_size"),
    (dict(prompt=[1, 2], method="dflash", block_size=17), "block_size"),
    (dict(prompt=[1, 2], temperature=-0.5), "temperature"),
    (dict(prompt=[1, 2], temperature=1.0, top_p=1.5), "top_p"),
    (dict(prompt=[1, 2], temperature=1.0, top_p=-0.2), "top_p"),
    (dict(prompt=[1, 2], top_k=-1), "top_k"),
    (dict(prompt=[1, 2, 128]), "prompt_ids[2]"),
    (dict(prompt="hello"), "prompt_text"),  # this server has no tokenizer
])
def test_invalid_argument_names_the_field(served, kw, field):
    kw.setdefault("max_tokens", 4)
    for call in (lambda: served.client.generate_once(**kw), lambda: list(served.client.generate(**kw))):
        e = _code(call)
        assert isinstance(e, GenerationInvalidArgument), e
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and field in str(e), e
    served.wait_freed()


def test_unset_prompt_and_bad_version(served):
    stub = pb_grpc.GenerationStub(served.client._channel)
    for req, field in ((pb.GenerateRequest(version=1, max_tokens=4), "prompt"),
                       (pb.GenerateRequest(version=2, max_tokens=4, prompt_ids=pb.TokenIds(ids=[1])), "version")):
        with pytest.raises(grpc.RpcError) as ei:
            stub.GenerateOnce(req, timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in ei.value.details()


def test_resource_exhausted_and_failed_precondition(served, small_native):
    e = _code(lambda: served.client.generate_once([1] * 100, max_tokens=4096))  # beyond the model's positions
    assert isinstance(e, GenerationResourceExhausted) and "max_tokens" in str(e)
    e = _code(lambda: small_native.client.generate_once([1] * 100, max_tokens=100))  # > 8 KV blocks: PromptTooLong
    assert isinstance(e, GenerationResourceExhausted) and "KV" in str(e)
    e = _code(lambda: small_native.client.generate_once([1, 2], max_tokens=4, method="dflash"))
    assert isinstance(e, GenerationFailedPrecondition) and e.code == grpc.StatusCode.FAILED_PRECONDITION
    # the native-only server defaults to native and still serves
    assert len(small_native.client.generate_once([1, 2, 3], max_tokens=5).token_ids) == 5
    small_native.wait_freed()
    served.wait_freed()


def test_cancel_mid_stream_frees_kv_and_server_keeps_serving(served, solo):
    stub = pb_grpc.GenerationStub(served.client._channel)
    prompt = _prompts(1, 5)[0]
    for method in ("dflash", "native"):
        call = stub.Generate(build_request(prompt, max_tokens=3000, method=method, ignore_eos=True), timeout=60)
        got = []
        for msg in call:
            got.extend(msg.token_ids)
            assert not msg.finished
            if len(got) >= 5:
                break
        assert served.runner.allocator.num_free < served.free0  # it is holding KV now
        call.cancel()
        served.wait_freed()
        assert call.code() == grpc.StatusCode.CANCELLED
    out, _ = solo(prompt, 12, "dflash")
    assert served.client.generate_once(prompt, max_tokens=12, method="dflash", ignore_eos=True).token_ids == out


def test_closing_the_client_iterator_cancels(served):
    it = served.client.generate(_prompts(1, 9)[0], max_tokens=3000, method="native", ignore_eos=True)
    next(it)
    it.close()
    served.wait_freed()


def test_tiny_deadline_gives_deadline_exceeded(served):
    for call in (lambda: served.client.generate_once([1, 2, 3], max_tokens=3000, ignore_eos=True, timeout_s=0.05),
                 lambda: list(served.client.generate([1, 2, 3], max_tokens=3000, ignore_eos=True, timeout_s=0.05))):
        e = _code(call)
        assert isinstance(e, GenerationTimeout) and e.code == grpc.StatusCode.DEADLINE_EXCEEDED, e
    served.wait_freed()
    assert served.client.health()["serving"]


def test_health(served, small_native):
    h = served.client.health()
    assert h["serving"] and h["has_drafter"] and not h["has_tokenizer"] and h["vocab_size"] == 128
    h = small_native.client.health()
    assert h["serving"] and not h["has_drafter"] and h["kv_blocks_free"] == small_native.free0


def test_loopback_only(served):
    with pytest.raises(ValueError, match="loopback"):
        serve_generation(served.loop, host="0.0.0.0")


def test_generated_code_has_not_drifted(tmp_path):
    gen = pytest.importorskip("flashpd.kv_bridge.gen_proto")
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a test extra) regenerates the modules")
    fresh = gen.generate_generation(tmp_path / "proto_gen")
    for p in fresh:
        committed = gen.GEN_OUT_DIR / p.name
        assert committed.exists(), f"{committed} missing: run python -m flashpd.kv_bridge.gen_proto"
        assert filecmp.cmp(p, committed, shallow=False), (
            f"{committed.name} differs from what proto/generation.proto generates: "
            "run python -m flashpd.kv_bridge.gen_proto (with the pinned grpcio-tools)")


def test_cli_serve_and_client(dflash_pair, solo, tmp_path, capsys):  # noqa: F811
    import json

    from flashpd.cli import main as cli_main

    cfg = tmp_path / "serve.json"
    cfg.write_text(json.dumps({"target": str(dflash_pair.target_dir), "draft": str(dflash_pair.draft_dir),
                               "device": "cpu", "dtype": "float32", "host": "127.0.0.1", "port": 0,
                               "kv_cache_tokens": 4096}))
    with serve_process([str(cfg)]) as (address, _):
        prompt = _prompts(1, 21)[0]
        assert cli_main(["client", "--address", address, "--prompt-ids", ",".join(map(str, prompt)),
                         "--max-tokens", "16", "--method", "dflash", "--ignore-eos", "--timeout", "30"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["token_ids"] == solo(prompt, 16, "dflash")[0] and out["finish_reason"] == "length"
        # --stream's last line is the same object (its "text" was left out)
        assert cli_main(["client", "--address", address, "--prompt-ids", ",".join(map(str, prompt)),
                         "--max-tokens", "16", "--method", "dflash", "--ignore-eos", "--timeout", "30",
                         "--stream"]) == 0
        streamed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert {k: v for k, v in streamed.items() if k != "stats"} == {k: v for k, v in out.items() if k != "stats"}
        assert cli_main(["client", "--address", address, "--prompt-ids", "1,2", "--max-tokens", "0"]) == 1
        assert "max_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("kw, field", [
    (dict(prompt=[1, 2.5]), "prompt_ids"),  # was silently truncated to 2
    (dict(prompt=[1, -1]), "prompt_ids[1]"),
    (dict(prompt=[1, 1 << 32]), "prompt_ids[1]"),
    (dict(prompt="a\ud800b"), "prompt_text"),  # a lone surrogate: protobuf's UnicodeEncodeError before
    (dict(prompt=[1], max_tokens=1 << 40), "max_tokens"),
    (dict(prompt=[1], max_tokens=2.5), "max_tokens"),
    (dict(prompt=[1], block_size=-1), "block_size"),
    (dict(prompt=[1], temperature="hot"), "temperature"),
    (dict(prompt=[1], seed=1.5), "seed"),
    (dict(prompt=[1], top_p=0.0), "top_p"),  # 0 reads as unset on the wire: it sampled with no filtering
    (dict(prompt=[1], top_p=0), "top_p"),
])
def test_client_refuses_what_the_wire_cannot_carry(kw, field):
    """Nothing is sent: the client raises GenerationInvalidArgument (still a ValueError) naming the field, for
    every call form, instead of protobuf's bare ValueError / TypeError / UnicodeEncodeError or a truncation."""
    c = GenerationClient("127.0.0.1:1", timeout_s=5)  # nothing listens there; no RPC may be attempted
    try:
        for call in (lambda: c.generate_once(**kw), lambda: list(c.generate(**kw))):
            e = _code(call)
            assert isinstance(e, GenerationInvalidArgument) and isinstance(e, ValueError), repr(e)
            assert e.code is None and field in str(e), e
    finally:
        c.close()


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf"), 1e30, "5"])
def test_client_refuses_a_deadline_grpc_cannot_keep(timeout_s):
    """0, negative and NaN deadlines reached the server and came back DEADLINE_EXCEEDED; 1e30 overflowed in gRPC
    and failed at once: each is a ValueError naming timeout_s, at construction or per call, with no RPC."""
    with pytest.raises(ValueError, match="timeout_s: must be a number of seconds"):
        GenerationClient("127.0.0.1:1", timeout_s=timeout_s)
    c = GenerationClient("127.0.0.1:1", timeout_s=5)
    try:
        for call in (lambda: c.generate_once([1], timeout_s=timeout_s), lambda: list(c.generate([1], timeout_s=timeout_s)),
                     lambda: c.health(timeout_s=timeout_s)):
            with pytest.raises(ValueError, match="timeout_s: must be a number of seconds"):
                call()
    finally:
        c.close()


def test_client_refuses_a_port_past_65535():
    """gRPC dialed 127.0.0.1:99999 as port 34463 (modulo 65536): another server's, perhaps."""
    with pytest.raises(ValueError, match="port 99999 is not in"):
        GenerationClient("127.0.0.1:99999")
    GenerationClient("127.0.0.1:65535").close()
    GenerationClient("[::1]:50051").close()


def test_closed_client_says_so():
    c = GenerationClient("127.0.0.1:1", timeout_s=5)
    c.close()
    for call in (lambda: c.generate_once([1, 2]), lambda: list(c.generate([1, 2])), c.health):
        e = _code(call)
        assert type(e) is GenerationError and "closed" in str(e), repr(e)



def test_text_is_tokenized_by_the_call_that_lets_go_of_the_interpreter_lock():
    """The tokenizers library's `encode` holds the interpreter lock for the whole text (0.15 s for 260k characters),
    stalling every stream and, in-process, the engine loop; its batch call lets go of it. TextTokenizer.encode
    (what the gRPC and HTTP front ends call) takes the batch call, and gives the single call's ids."""
    from pathlib import Path

    from flashpd.engine.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair" / "target")
    lib, calls = tok._tok, []

    class Spy:
        def encode(self, *a, **k):
            calls.append("encode")
            return lib.encode(*a, **k)

        def encode_batch(self, *a, **k):
            calls.append("encode_batch")
            return lib.encode_batch(*a, **k)

    text = "def f(x):\n    return x * 2  # é 中文 🙂\n" * 50
    tok._tok = Spy()
    got = tok.encode(text)
    assert calls == ["encode_batch"] and got == lib.encode(text, add_special_tokens=False).ids


def test_the_client_cli_refuses_a_block_size_for_native_as_generate_does(capsys):
    from flashpd.cli import main as cli_main

    assert cli_main(["client", "--address", "127.0.0.1:1", "--prompt-ids", "1,2", "--method", "native",
                     "--block-size", "4"]) != 0
    assert "--block-size 4 needs --method dflash" in capsys.readouterr().err

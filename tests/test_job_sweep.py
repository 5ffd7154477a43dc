"""The load-sweep entrypoint (`python -m flashpd.bench.job_sweep`): run without Ray importable (the
local launcher, as on a GPU machine without ray), and submitted with `ray job submit` to a real
local Ray cluster (`ray start --head` on free ports, stopped in teardown). Both write the JSON
with every (mode, method, concurrency) run, and colocated and disaggregated outputs match."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests._cluster_helpers import dflash_pair  # noqa: F401  (session fixture)

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--concurrency", "1,4", "--requests", "4", "--max-tokens", "8", "--prompt-tokens", "64", "--warmup", "1",
         "--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "4096", "--torch-threads", "1",
         "--chunk-tokens", "32", "--start-timeout-s", "180", "--request-timeout-s", "60"]


def _check(out: Path, launcher: str, long_every: int = 0) -> None:
    d = json.loads(out.read_text())
    assert d["kind"] == "serve_sweep" and d["settings"]["launcher"] == launcher
    rows = {(r["mode"], r["method"], r["concurrency"]) for r in d["runs"]}
    assert rows == {(m, k, c) for m in ("colocated", "disaggregated") for k in ("native", "dflash") for c in (1, 4)}
    for r in d["runs"]:
        assert r["errors"] == 0 and r["requests"] == 4 and r["output_tokens"] == 32, r
        assert r["ttft_ms"]["p50"] > 0 and r["latency_ms"]["p95"] >= r["latency_ms"]["p50"] > 0
        assert r["output_tokens_per_s"] > 0 and (r["tau"] is None) == (r["method"] == "native")
    for r in d["runs"]:  # one long prompt in each set of 4, timed on its own
        assert ("ttft_long_ms" in r) == (long_every > 0)
        if long_every:
            assert r["ttft_long_ms"]["n"] == 1 and r["ttft_long_ms"]["p50"] > 0, r
    assert d["exact"]["compared"] == 16 and d["exact"]["match_rate"] == 1.0, d["exact"]
    assert d["git"] and d["machine"]
    assert d["command"].startswith("python -m flashpd.bench.job_sweep --") and "--out" in d["command"]  # reproducible


def test_sweep_runs_on_the_local_launcher_without_ray(dflash_pair, tmp_path):  # noqa: F811
    hidden = tmp_path / "no_ray"
    (hidden / "ray").mkdir(parents=True)
    (hidden / "ray" / "__init__.py").write_text('raise ImportError("ray is hidden for this test")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "sweep.json"
    p = subprocess.run([sys.executable, "-m", "flashpd.bench.job_sweep", "--target", str(dflash_pair.target_dir),
                        "--draft", str(dflash_pair.draft_dir), "--out", str(out), *SMALL,
                        "--long-every", "4", "--long-prompt-tokens", "300", "--bridge-transport", "arena"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    _check(out, "local", long_every=4)
    settings = json.loads(out.read_text())["settings"]
    assert settings["long_prompt_tokens"] == 300 and settings["bridge_transport"] == "arena"


def test_prompt_sets_mix_long_prompts(dflash_pair):  # noqa: F811
    from flashpd.bench.job_sweep import make_prompts, prompt_lengths

    lens = prompt_lengths(9, 64, 4, 300)
    assert lens == [300, 64, 64, 64, 300, 64, 64, 64, 300] and prompt_lengths(3, 64, 0, 300) == [64] * 3
    prompts = make_prompts(str(dflash_pair.target_dir), lens, seed=0)
    assert [len(x) for x in prompts] == lens


def test_prompt_sets_refuse_to_outgrow_the_held_out_text():
    """A trained pair's prompts come from held-out text; more than it holds is an error, not random ids."""
    from flashpd.bench.job_sweep import make_prompts
    from flashpd.demo import PAIR

    with pytest.raises(ValueError, match="held-out text gives"):
        make_prompts(str(PAIR / "target"), [100_000_000], seed=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RAY_AGENT_PORT = 52365  # Ray's default port for a node's dashboard agent (its HTTP server takes job submissions)


def _hold(port: int) -> socket.socket:
    """A listening socket on `port` until closed (when someone else holds the port, it is busy all the same)."""
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", port))
        s.listen()
    except OSError:
        pass
    return s


@pytest.fixture
def ray_head(tmp_path_factory):
    """`ray start --head --block` in its own session, with its own auth token (nothing read from or
    written to ~/.ray); teardown stops that process (it stops its children), then kills what is
    left of the process group it leads, by its id.

    Every port it listens on is a free one, the dashboard agent's included: at Ray's default (52365) another
    cluster on the host (a test running beside this one) held it, the agent ran without its HTTP server, and
    every submission was refused with "No available agent". The default is held busy while the head starts,
    so a head that used it would fail here every time."""
    pytest.importorskip("ray")
    ray_bin = Path(sys.executable).parent / "ray"
    port, dash, client, agent = _free_port(), _free_port(), _free_port(), _free_port()
    temp = Path("/tmp") / f"ray-fpd-{os.getpid()}-{port}"  # short: Ray's socket paths have a length limit
    log = tmp_path_factory.mktemp("ray_head") / "ray_start.log"
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    busy = _hold(RAY_AGENT_PORT)  # for the head's whole life: its agent starts after `ray start` returns
    with open(log, "w") as f:
        proc = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                                 "--port", str(port), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
                                 "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
                                 "--include-dashboard", "true",
                                 "--num-cpus", "4", "--num-gpus", "0", "--temp-dir", str(temp),
                                 "--disable-usage-stats"],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                req = urllib.request.Request(f"{url}/api/version",
                                             headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
                urllib.request.urlopen(req, timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"Ray dashboard did not come up: {log.read_text()[-3000:]}") from None
                time.sleep(1)
        yield url, ray_bin, env
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group this fixture started
        except ProcessLookupError:
            pass
        proc.wait(20)
        busy.close()


def test_ray_job_submit_runs_the_sweep(ray_head, dflash_pair, tmp_path):  # noqa: F811
    url, ray_bin, env = ray_head
    out = tmp_path / "sweep.json"
    runtime_env = {"excludes": [".git", ".venv", "**/__pycache__", ".pytest_cache", "bench/results"],
                   "env_vars": {"PYTHONUNBUFFERED": "1"}}
    job_id = f"flashpd-sweep-{secrets.token_hex(4)}"
    cmd = [str(ray_bin), "job", "submit", "--address", url, "--submission-id", job_id, "--no-wait",
           "--working-dir", str(REPO), "--runtime-env-json", json.dumps(runtime_env), "--",
           sys.executable, "-m", "flashpd.bench.job_sweep", "--launcher", "ray",
           "--target", str(dflash_pair.target_dir), "--draft", str(dflash_pair.draft_dir), "--out", str(out), *SMALL]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    status = _await_job(ray_bin, url, job_id, env, timeout_s=420)
    logs = subprocess.run([str(ray_bin), "job", "logs", "--address", url, job_id], capture_output=True, text=True,
                          timeout=60, env=env)
    assert status == "SUCCEEDED", f"{status}\n{logs.stdout[-4000:]}{logs.stderr[-2000:]}"
    _check(out, "ray")
    # the kept service log says where Ray placed each worker (no GPUs here: empty GPU ids)
    served = Path(f"{out}.serve-disaggregated.log").read_text()
    for role in ("bridge", "prefill", "decode"):
        assert f"{role} worker placed on node" in served, served[-3000:]


def _await_job(ray_bin: Path, url: str, job_id: str, env: dict, timeout_s: float) -> str:
    """The job's terminal status, polled with `ray job status` (one HTTP request each; a transient failure of one
    is retried), not followed with `ray job submit`'s log tail: its WebSocket was closed (code 1006) under load
    and failed the test with the job still running."""
    deadline, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        p = subprocess.run([str(ray_bin), "job", "status", "--address", url, job_id], capture_output=True,
                           text=True, timeout=60, env=env)
        last = p.stdout + p.stderr
        for status, said in (("SUCCEEDED", "succeeded"), ("FAILED", "failed"), ("STOPPED", "was stopped")):
            if p.returncode == 0 and f"Job '{job_id}' {said}" in last:
                return status
        time.sleep(2.0)
    subprocess.run([str(ray_bin), "job", "stop", "--address", url, job_id], capture_output=True, timeout=60, env=env)
    raise AssertionError(f"job {job_id} not finished after {timeout_s} s (stopped); last status: {last[-2000:]}")


def _fake_service(monkeypatch, tmp_path):
    """job_sweep with its service and its load replaced: what each call sent, and the configs it would serve."""
    from flashpd.bench import job_sweep as js
    from flashpd.bench.load_gen import RequestResult

    cfgs, sent = [], []

    class FakeServe:
        def __init__(self, cfg, workdir, start_timeout_s):
            cfgs.append(cfg)
            self.address, self.http_address, self.log_path = "127.0.0.1:1", None, workdir / "serve.log"
            self.log_path.write_text("")

        def stop(self):
            pass

    def load(address, prompts, c, timeout_s, **kw):
        sent.append((kw["method"], c, [tuple(p) for p in prompts]))
        al = [2, 3] if kw["method"] == "dflash" else []
        return [RequestResult(i, tokens=list(p[:kw["max_tokens"]]), ttft_ms=1.0, latency_ms=2.0, acceptance_lengths=al)
                for i, p in enumerate(prompts)], 1.0

    monkeypatch.setattr(js, "ServeProcess", FakeServe)
    monkeypatch.setattr(js, "run_load", load)
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps({"vocab_size": 100}))  # no tokenizer: random prompt ids
    return js, cfgs, sent, str(target)


def test_prompt_pool_levels_draw_from_one_pool(monkeypatch, tmp_path):
    """--prompt-pool: every level's requests come from one pool (the same sample for both methods; warm-ups from
    outside it), the colocated service's prefix cache is off whatever the base config says, and the JSON records
    the pool, each level's sample and native against DFlash per level."""
    js, cfgs, sent, target = _fake_service(monkeypatch, tmp_path)
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"target": "x", "device_cache_bytes": 1 << 20, "host_cache_bytes": 1 << 20}))
    out = tmp_path / "sweep.json"
    a = js.parse_args(["--out", str(out), "--target", target, "--draft", target, "--modes", "colocated",
                       "--concurrency", "1,4", "--prompt-pool", "5", "--requests", "7", "--warmup", "1",
                       "--max-tokens", "4", "--prompt-tokens", "6", "--config", str(base),
                       "--draft-width-policy", "batch:caps=1-16/4-1"])
    d = js.sweep(a)
    assert cfgs[0].device_cache_bytes == 0 == cfgs[0].host_cache_bytes
    assert cfgs[0].draft_width_policy == "batch:caps=1-16/4-1" == d["settings"]["draft_width_policy"]
    timed = {(m, c): p for m, c, p in sent if len(p) == 7}
    warm = {p for m, c, ps in sent if len(ps) == 1 for p in ps}
    pool = {p for ps in timed.values() for p in ps}
    assert len(timed) == 4 and len(pool) == 5 and not warm & pool
    for c in (1, 4):
        assert timed[("native", c)] == timed[("dflash", c)]
        assert d["settings"]["prompt_pool"]["samples"][c] == js.pool_sample(5, 7, 0, c)
    assert timed[("native", 1)] != timed[("native", 4)]  # each level its own draw of the same pool
    for r in d["runs"]:
        assert r["prompt_pool"] == {"size": 5, "seed": 0, "distinct_prompts": 5} and r["prefix_cache"] == "off", r
        assert r["requests"] == 7 and r["tau"] == (2.5 if r["method"] == "dflash" else None)
    assert d["exact_methods"] == {f"colocated c={c}": {"compared": 7, "identical": 7, "match_rate": 1.0}
                                  for c in (1, 4)}
    assert sorted(js.pool_sample(5, 12, 3, 8)[:5]) == list(range(5)) and len(set(js.pool_sample(5, 12, 3, 8))) == 5


def test_default_sweep_cuts_disjoint_sets_as_before(monkeypatch, tmp_path):
    """Without a pool: per method and level a warm-up set, then its timed set, cut in that order from one stream."""
    js, cfgs, sent, target = _fake_service(monkeypatch, tmp_path)
    a = js.parse_args(["--out", str(tmp_path / "s.json"), "--target", target, "--draft", target, "--modes",
                       "colocated", "--concurrency", "1,2", "--requests", "3", "--warmup", "1", "--max-tokens", "4",
                       "--prompt-tokens", "6"])
    d = js.sweep(a)
    stream = js.make_prompts(target, [6] * 16, 0)
    assert [ps for _, _, ps in sent] == [[tuple(p) for p in stream[i:i + n]]
                                        for i, n in zip((0, 1, 4, 5, 8, 9, 12, 13), (1, 3) * 4)]
    assert "exact_methods" not in d and d["settings"]["prompt_pool"] is None
    assert all(r["prefix_cache"] == "off" and "prompt_pool" not in r for r in d["runs"])


def test_the_serve_address_is_found_inside_a_forwarded_log_line():
    """Under Ray the driver copies its actors' logs into serve's stdout; a copy that lacked its newline took
    "listening on ..." into its line once, and the sweep waited out its start timeout (a CI failure)."""
    from flashpd.bench.job_sweep import _ANNOUNCED

    line = "(WorkerActor pid=9823) decode INFO keys: hashed in 0.0 slistening on 127.0.0.1:33909\n"
    assert _ANNOUNCED.search(line).groups() == ("listening", "127.0.0.1:33909")
    assert _ANNOUNCED.search("http on 127.0.0.1:8000\n").groups() == ("http", "127.0.0.1:8000")
    assert _ANNOUNCED.search("metrics on 127.0.0.1:9\n") is None
    # and one that landed between "listening on ..." and its newline (print writes them apart: a CI failure too)
    line = "listening on 127.0.0.1:40445\x1b[36m(WorkerActor pid=22539)\x1b[0m 2026-12-06 12:00:49,034 prefill INFO\n"
    assert _ANNOUNCED.search(line).groups() == ("listening", "127.0.0.1:40445")
    assert _ANNOUNCED.search("listening on [::1]:50051\n").groups() == ("listening", "[::1]:50051")


def test_a_config_file_fills_the_flags_not_given(monkeypatch, tmp_path):
    """--config (YAML too, as `flashpd serve` reads it): its sizes were overridden by flags never given (the sweep
    ran max_running 128 and one decode worker whatever the file said), and YAML failed with a JSON traceback."""
    js, cfgs, _, target = _fake_service(monkeypatch, tmp_path)
    base = tmp_path / "base.yaml"
    base.write_text(f"target: {target}\nmax_running: 8\ndecode_workers: 2\nchunk_tokens: 64\nengine_process: true\n"
                    "num_gpus: 0.5\n")
    a = js.parse_args(["--out", str(tmp_path / "s.json"), "--modes", "colocated,disaggregated", "--launcher",
                       "local", "--concurrency", "1", "--requests", "2", "--warmup", "0", "--max-tokens", "2",
                       "--prompt-tokens", "6", "--config", str(base), "--max-running", "16"])
    assert a.target == target and a.draft is None  # the file's target; no demo drafter beside it
    d = js.sweep(a)
    colo, local = cfgs
    assert (colo.max_running, colo.decode_workers, colo.chunk_tokens) == (16, 2, 64)  # a flag given wins
    assert colo.engine_process is True and local.engine_process is None  # colocated's key, dropped for local
    assert colo.num_gpus is None is local.num_gpus  # a ray key, in neither mode
    assert d["settings"]["decode_workers"] == 2 and d["settings"]["chunk_tokens"] == 64


@pytest.mark.parametrize("args, msg", [
    (["--concurrency", "0"], "--concurrency: levels must be >= 1"),
    (["--concurrency", "4,-1"], "--concurrency: levels must be >= 1"),
    (["--config", "MISSING"], "--config: "),
    (["--config", "DIR"], "--config: .*is a directory"),
])
def test_bad_sweep_arguments_are_refused_before_anything_starts(tmp_path, capsys, args, msg):
    from flashpd.bench import job_sweep as js

    args = [str(tmp_path) if x == "DIR" else str(tmp_path / "nope.yaml") if x == "MISSING" else x for x in args]
    with pytest.raises(SystemExit):
        js.parse_args(["--out", str(tmp_path / "s.json"), *args])
    import re
    assert re.search(msg, capsys.readouterr().err), msg


def test_sigterm_unwinds_the_sweep_so_it_stops_its_service(tmp_path):
    """A plain SIGTERM killed the sweep without its `finally`: the `flashpd serve` it started went on serving."""
    marker = tmp_path / "stopped"
    code = (
        "import sys, time\n"
        "from flashpd.bench import job_sweep as js\n"
        "def sweep(a):\n"
        "    try:\n"
        "        print('started', flush=True)\n"
        "        time.sleep(60)\n"
        "    finally:\n"
        f"        open({str(marker)!r}, 'w').write('stopped')\n"
        "js.sweep = sweep\n"
        f"sys.exit(js.main(['--out', {str(tmp_path / 's.json')!r}, '--launcher', 'local']))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "started"
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 128 + signal.SIGTERM
    finally:
        p.kill()
    assert marker.read_text() == "stopped"


def test_a_colocated_only_sweep_records_its_settings_with_a_cuda_n_device(monkeypatch, tmp_path):
    """The settings read the disaggregated mode's config even for a colocated-only sweep: a config fit for colocated
    alone (device cuda:1, refused for workers) failed there, after the whole sweep ran, and no JSON was written."""
    js, cfgs, _, target = _fake_service(monkeypatch, tmp_path)
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"target": target, "device": "cuda:1", "dtype": "float32"}))
    a = js.parse_args(["--out", str(tmp_path / "s.json"), "--modes", "colocated", "--concurrency", "1",
                       "--requests", "2", "--warmup", "0", "--max-tokens", "2", "--prompt-tokens", "6",
                       "--config", str(base)])
    d = js.sweep(a)
    assert cfgs[0].device == "cuda:1"
    assert d["settings"]["device"] == "cuda:1" and d["settings"]["dtype"] == "float32"  # the config's, not None
    assert d["settings"]["bridge_transport"] is None


def test_an_interrupted_start_stops_the_serve_child(tmp_path, monkeypatch):
    """A SIGTERM (or Ctrl-C) while `flashpd serve` loads left the child running: the start was outside the
    sweep's try/finally."""
    from flashpd.bench import job_sweep as js
    from flashpd.cluster.config import ServeConfig

    started = []

    def interrupted(self, lines, timeout_s, cfg):
        started.append(self.proc)
        raise KeyboardInterrupt

    monkeypatch.setattr(js.ServeProcess, "_wait_listening", interrupted)
    cfg = ServeConfig(target=str(REPO / "flashpd" / "assets" / "demo_pair" / "target"), device="cpu", port=0)
    with pytest.raises(KeyboardInterrupt):
        js.ServeProcess(cfg, tmp_path, 60.0)
    assert started and started[0].poll() is not None, "the serve child is still running"


def test_a_sweep_of_a_running_service_records_its_transports(monkeypatch, tmp_path):
    """--address: the settings record the running service's own knobs, its KV transports too (they were None)."""
    js, _, _, target = _fake_service(monkeypatch, tmp_path)
    reported = {"mode": "local", "bridge_transport": "arena", "kv_transport": "device", "device": "cuda",
                "dtype": "bfloat16", "max_running": 64}
    monkeypatch.setattr(js, "service_settings", lambda address, timeout_s: reported)
    a = js.parse_args(["--out", str(tmp_path / "s.json"), "--address", "127.0.0.1:1", "--target", target,
                       "--concurrency", "1", "--requests", "2", "--warmup", "0", "--max-tokens", "2",
                       "--prompt-tokens", "6"])
    s = js.sweep(a)["settings"]
    assert (s["bridge_transport"], s["kv_transport"], s["device"], s["dtype"]) == ("arena", "device", "cuda",
                                                                                   "bfloat16")

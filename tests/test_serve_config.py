"""The service's config files (JSON, YAML, the shipped ray_configs/) and worker placement rules."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flashpd.cluster.config import ServeConfig, load_config
from flashpd.cluster.placement import gpu_share, local_gpu, ray_options

REPO = Path(__file__).resolve().parent.parent


def test_json_and_yaml_configs_load_the_same(tmp_path):
    d = {"target": "t", "draft": "d", "mode": "local", "prefill_workers": 2, "metrics_port": 0}
    (tmp_path / "a.json").write_text(json.dumps(d))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(d))
    (tmp_path / "a.conf").write_text(yaml.safe_dump(d))  # no known suffix: JSON, then YAML
    cfgs = [load_config(tmp_path / n) for n in ("a.json", "a.yaml", "a.conf")]
    assert cfgs[0] == cfgs[1] == cfgs[2] == ServeConfig(**d)
    assert ServeConfig.from_dict(cfgs[0].to_dict()) == cfgs[0]


@pytest.mark.parametrize("d, msg", [
    ({"target": "t", "mdoe": "ray"}, "mdoe"),
    ({"target": "t", "mode": "cluster"}, "mode"),
    ({"target": "t", "decode_workers": 0}, "decode_workers"),
    ({"target": "t", "policy": "lifo"}, "policy"),
    ({"target": "t", "health_timeout_s": 0}, "health_timeout_s"),
    ({"draft": "d"}, "target"),
    ({"target": "t", "gil_switch_interval_s": 0}, "gil_switch_interval_s"),
    ({"target": "t", "session_hold_fraction": 1.5}, "session_hold_fraction"),
    ({"target": "t", "session_hold_steps": 0}, "session_hold_steps"),
    ({"target": "t", "gil_switch_interval_s": 2}, "gil_switch_interval_s"),
    ({"target": "t", "max_running": "64"}, "max_running: must be int, got '64'"),
    ({"target": "t", "decode_workers": "2"}, "decode_workers: must be int"),
    ({"target": "t", "kv_cache_tokens": "4096"}, "kv_cache_tokens: must be int or null"),
    ({"target": None}, "target: must be str"),
    ({"target": "t", "restart": 1}, "restart: must be bool"),
    ({"target": "t", "port": 70000}, r"port: must be a port number in \[0, 65535\]"),
    ({"target": "t", "port": -1}, "port: must be a port number"),
    ({"target": "t", "metrics_port": 70000}, "metrics_port: must be a port number"),
    ({"target": "t", "port": "abc"}, "port: must be int"),
    ({"target": "t", "kv_cache_tokens": -5}, "kv_cache_tokens: must be >= 1"),
    ({"target": "t", "kv_cache_tokens": 0}, "kv_cache_tokens: must be >= 1"),
    ({"target": "t", "device": "tpu"}, "device: must be 'cpu', 'cuda'"),
    ({"target": "t", "dtype": "int8"}, "dtype: must be"),
    ({"target": "t", "bridge_memory_bytes": -1}, "bridge_memory_bytes: must be >= 1"),
    ({"target": "t", "bridge_disk_bytes": 0}, "bridge_disk_bytes: must be >= 1"),
    ({"target": "t", "bridge_shm_pool_bytes": -1}, "bridge_shm_pool_bytes: must be >= 0"),
    ({"target": "t", "prefix_stage_bytes": -1}, "prefix_stage_bytes: must be >= 0"),
    ({"target": "t", "prefill_publish": "later"}, "prefill_publish: must be 'after_answer' or 'before_answer'"),
    ({"target": "t", "decode_retries": -1}, "decode_retries: must be >= 0"),
    ({"target": "t", "fault_prefill_delay_s": -0.5}, "fault_prefill_delay_s: must be in"),
    ({"target": "t", "fault_prefill_delay_s": float("nan")}, "fault_prefill_delay_s: must be in"),
    ({"target": "t", "health_interval_s": 1e30}, "health_interval_s: must be in"),  # killed the supervisor thread
    ({"target": "t", "health_timeout_s": 1e30}, "health_timeout_s: must be in"),  # every probe failed at once
    ({"target": "t", "handoff_lease_s": float("inf")}, "handoff_lease_s: must be in"),
    ({"target": "t", "torch_threads": 0}, "torch_threads: must be in"),  # was ignored
    ({"target": ""}, "target: must be a checkpoint directory"),  # was ".: no config.json"
    ({"target": "t", "torch_threads": -1}, "torch_threads: must be in"),  # a traceback in the worker
    ({"target": "t", "torch_threads": 100000}, "torch_threads: must be in"),  # crashed the engine
    ({"target": "t", "port": 47222, "http_port": 47222}, "port and http_port: the same port"),
    ({"target": "t", "http_port": 47223, "metrics_port": 47223}, "http_port and metrics_port: the same port"),
    ({"target": "t", "num_gpus": 0}, "num_gpus: must be > 0"),
    ({"target": "t", "device": "cuda:abc"}, "device: must be 'cpu', 'cuda', 'cuda:N'"),  # was accepted
    ({"target": "t", "mode": "local", "device": "cuda:1"}, "device: 'cuda:1' in mode 'local': each worker sees"),
    ({"target": "t", "mode": "ray", "device": "cuda:2"}, "device: 'cuda:2' in mode 'ray'"),
    ({"target": "t", "mode": "ray", "num_gpus": float("inf")}, "num_gpus: must be > 0"),  # failed inside Ray
    ({"target": "t", "mode": "ray", "num_gpus": float("nan")}, "num_gpus: must be > 0"),
    ({"target": "t", "mode": "ray", "num_gpus": 1e-9}, "num_gpus: must be > 0"),  # below Ray's resolution
    ({"target": "t", "mode": "local", "num_gpus": 0.5}, "num_gpus: applies to mode 'ray' only"),  # was ignored
    ({"target": "t", "ray_address": "auto"}, "ray_address: applies to mode 'ray' only"),
    ({"target": "t", "mode": "ray", "device": "cpu", "num_gpus": 1}, "num_gpus: 1 with device 'cpu'"),
    ({"target": "t", "stall_s": 0}, "stall_s: must be in"),
    ({"target": "t", "stall_s": -1.0}, "stall_s: must be in"),
    ({"target": "t", "stall_s": float("inf")}, "stall_s: must be in"),  # JSON's Infinity
    ({"target": "t", "request_timeout_s": float("nan")}, "request_timeout_s: must be in"),
    ({"target": "t", "stall_s": "300"}, "stall_s: must be float"),
    ({"target": "t", "prefill_workers": 100000}, "prefill_workers: at most"),
    ({"target": "t", "host": "0.0.0.0"}, "host: '0.0.0.0' is not loopback"),  # before any worker starts
])
def test_bad_configs_are_refused_by_name(tmp_path, d, msg):
    (tmp_path / "c.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=msg):
        load_config(tmp_path / "c.json")


def test_shipped_ray_configs_parse():
    cfg = load_config(REPO / "ray_configs" / "serve_ray.yaml")
    assert cfg.mode == "ray" and cfg.device == "cuda"
    cpu = load_config(REPO / "ray_configs" / "serve_cpu.yaml")  # the CPU one beside it (started by hand: README)
    assert cpu.mode == "local" and cpu.device == "cpu" and cpu.http_port == 8000
    cluster = yaml.safe_load((REPO / "ray_configs" / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    assert {"head", "prefill", "decode"} <= set(types)
    assert "flashpd_prefill" in types["prefill"]["resources"] and "flashpd_decode" in types["decode"]["resources"]
    env = yaml.safe_load((REPO / "ray_configs" / "runtime_env.yaml").read_text())
    assert env["working_dir"] == "." and ".venv" in env["excludes"]


def _cfg(p: int = 1, d: int = 1, **kw) -> ServeConfig:
    return ServeConfig(target="t", mode="ray", prefill_workers=p, decode_workers=d, **kw)


@pytest.mark.parametrize("gpus, p, d, share", [(0, 1, 1, 0.0), (1, 1, 1, 0.5), (1, 1, 3, 0.25), (2, 1, 1, 1.0),
                                               (2, 2, 2, 0.5), (8, 3, 5, 1.0)])
def test_gpu_share(gpus, p, d, share):
    assert gpu_share(_cfg(p, d), gpus) == share


def test_gpu_share_overrides_and_cpu():
    assert gpu_share(_cfg(num_gpus=0.3), 4) == 0.3
    assert gpu_share(_cfg(device="cpu"), 4) == 0.0


def test_ray_options_pin_roles_when_the_cluster_has_node_types():
    plain = {"CPU": 16.0, "GPU": 2.0}
    typed = {**plain, "flashpd_prefill": 8.0, "flashpd_decode": 8.0, "flashpd_bridge": 1.0}
    assert ray_options("decode", _cfg(), plain) == {"num_cpus": 1, "num_gpus": 1.0}
    assert ray_options("bridge", _cfg(), plain) == {"num_cpus": 0, "num_gpus": 0}
    assert ray_options("prefill", _cfg(), typed)["resources"] == {"flashpd_prefill": 0.001}
    assert ray_options("bridge", _cfg(), typed)["resources"] == {"flashpd_bridge": 0.001}


def test_local_gpu_keeps_prefill_and_decode_apart():
    c = _cfg()
    assert (local_gpu("prefill", 0, c, 2), local_gpu("decode", 0, c, 2)) == (0, 1)
    assert (local_gpu("prefill", 0, c, 1), local_gpu("decode", 0, c, 1)) == (0, 0)
    assert local_gpu("decode", 0, c, 0) is None and local_gpu("bridge", 0, c, 2) is None
    assert local_gpu("decode", 0, _cfg(device="cpu"), 2) is None


def test_a_local_worker_is_pinned_through_the_parents_gpu_mask():
    """Under CUDA_VISIBLE_DEVICES=2,3 this process's GPU 1 is physical GPU 3: the child must get "3", not "1"."""
    from flashpd.cluster.local_launcher import visible_device
    assert visible_device(1, None) == "1" and visible_device(0, "") == "0"
    assert visible_device(1, "2,3") == "3" and visible_device(0, " 2 , 3 ") == "2"
    assert visible_device(0, "GPU-aaaa,GPU-bbbb") == "GPU-aaaa"
    with pytest.raises(ValueError, match="not among"):
        visible_device(2, "2,3")


def test_a_model_process_takes_the_configured_switch_interval():
    """load_model (every process that holds an engine: colocated, local and Ray workers) sets the interpreter's
    switch interval from the config; None leaves Python's."""
    import sys

    from flashpd.cluster.worker_main import load_model
    demo = REPO / "flashpd" / "assets" / "demo_pair"
    before = sys.getswitchinterval()
    try:
        for asked, want in ((0.002, 0.002), (None, 0.002), (ServeConfig(target="t").gil_switch_interval_s, 0.0005)):
            cfg = ServeConfig(target=str(demo / "target"), device="cpu", dtype="float32", kv_cache_tokens=512,
                              gil_switch_interval_s=asked)
            load_model(cfg)
            assert sys.getswitchinterval() == pytest.approx(want)
    finally:
        sys.setswitchinterval(before)


def test_serve_exits_non_zero_when_its_engine_dies(tmp_path):
    """Nobody asked it to stop: `flashpd serve` says so and exits 1 (a supervisor must not read a clean exit)."""
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    import psutil  # noqa: PLC0415

    demo = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"
    (tmp_path / "c.json").write_text(json.dumps({"target": str(demo / "target"), "device": "cpu",
                                                 "dtype": "float32", "kv_cache_tokens": 2048, "torch_threads": 1}))
    proc = subprocess.Popen([sys.executable, "-m", "flashpd.cli", "serve", str(tmp_path / "c.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out = []
        for ln in proc.stdout:  # up to "listening on": the engine process is ready
            out.append(ln)
            if ln.startswith("listening on "):
                break
        kids = psutil.Process(proc.pid).children()
        assert kids, "".join(out)
        os.kill(kids[0].pid, signal.SIGKILL)  # the engine process
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 1, rest[-2000:]
        assert "the service stopped serving" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_held_public_port_is_refused_by_name_before_any_worker_starts(monkeypatch):
    """A fixed port another process listens on: start_service says which field, before it launches a worker
    (a launcher that would start one fails the test); and a second generation server on a port one already
    serves is refused (grpcio's SO_REUSEPORT let it start and share the connections)."""
    import socket

    from flashpd.cluster import service
    from flashpd.cluster.generation_server import serve_generation

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]

    class NoLaunch:
        secret = None

        def __getattr__(self, name):
            raise AssertionError(f"a worker was started ({name})")

    try:
        for field in ("port", "http_port", "metrics_port"):
            cfg = ServeConfig(target="t", mode="local", **{field: port})
            with pytest.raises(OSError, match=rf"^{field}: 127.0.0.1:{port} is in use"):
                service.start_service(cfg, NoLaunch())
    finally:
        holder.close()
    server, bound = serve_generation(None, port=0)
    try:
        with pytest.raises(OSError, match=f"port: could not bind 127.0.0.1:{bound}"):
            serve_generation(None, port=bound)
    finally:
        server.stop(None)


def test_the_stall_bound_is_the_configs_stall_s_never_under_twice_the_prefill_timeout():
    """worker_main.stall_bound: how long a prefill, or a decode step while requests wait, runs before the worker is
    taken for hung (its Health says not serving). The worker tests in test_launch_robustness.py set stall_s: 1 and
    see it used."""
    from flashpd.cluster.worker_main import stall_bound  # noqa: PLC0415

    assert ServeConfig(target="t").stall_s == 300.0
    assert stall_bound(ServeConfig(target="t")) == 300.0
    assert stall_bound(ServeConfig(target="t", stall_s=50.0, prefill_timeout_s=10.0)) == 50.0
    assert stall_bound(ServeConfig(target="t", stall_s=5.0, prefill_timeout_s=10.0)) == 20.0
    assert stall_bound(ServeConfig(target="t", stall_s=600)) == 600  # an int is a float here, as everywhere
    assert ServeConfig.from_dict(ServeConfig(target="t", stall_s=42.0).to_dict()).stall_s == 42.0  # to the workers


@pytest.mark.parametrize("name, text", [("c.json", '{"target": "a", "port": 1, "port": 2}'),
                                        ("c.yaml", "target: a\nport: 1\nport: 2\n"),
                                        ("c.conf", '{"target": "a", "port": 1, "port": 2}')])
def test_a_key_given_twice_is_refused_by_name(tmp_path, name, text):
    """JSON and YAML parsers keep a repeated key's last value without a word: a config is refused instead."""
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match="'port' is given twice"):
        load_config(tmp_path / name)


def test_a_binary_config_is_refused_naming_the_file(tmp_path):
    (tmp_path / "c.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"c.json: not a text file"):
        load_config(tmp_path / "c.json")


def test_yaml_merge_keys_still_load_and_may_be_overridden(tmp_path):
    """The duplicate check leaves YAML's `<<` alone: a merged mapping, and a key that overrides what it merged."""
    (tmp_path / "c.yaml").write_text("target: t\n<<: {mode: local, port: 50051}\nport: 50052\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.mode, cfg.port) == ("local", 50052)


def test_a_key_that_is_not_a_name_is_refused_by_name(tmp_path):
    """A YAML key such as `1:` beside a misspelt one raised a bare TypeError from sorting the unknown keys."""
    (tmp_path / "c.yaml").write_text("target: t\n1: 2\nfoo: 3\n")
    with pytest.raises(ValueError, match="config keys must be names, got 1"):
        load_config(tmp_path / "c.yaml")


def test_a_directory_given_as_the_config_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="is a directory, not a config file"):
        load_config(tmp_path)


def test_paths_sent_to_a_ray_actor_are_absolute(tmp_path, monkeypatch):
    """An actor resolved a relative target where `ray start` ran, not where `flashpd serve` did."""
    monkeypatch.chdir(tmp_path)
    cfg = ServeConfig(target="pair/target", draft="pair/drafter", mode="ray", bridge_disk_dir="disk")
    out = cfg.with_absolute_paths()
    assert out.target == str(tmp_path / "pair/target") and out.draft == str(tmp_path / "pair/drafter")
    assert out.bridge_disk_dir == str(tmp_path / "disk") and out.tls_cert is None and out.draft_token_map is None
    assert out.with_absolute_paths() == out and out.mode == "ray"


def test_yaml_reads_an_exponent_without_a_dot_as_json_does(tmp_path):
    """YAML 1.1 (PyYAML) read 1e3 as the string "1e3", refused as not a float, where JSON's 1e3 is 1000.0."""
    (tmp_path / "c.yaml").write_text("target: t\nprefill_timeout_s: 1e3\nstall_s: -2.5E+2\n")
    with pytest.raises(ValueError, match="stall_s: must be in"):  # parsed as a number: the range check speaks
        load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("target: t\nprefill_timeout_s: 1e3\nserved_model_name: 1e3x\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.prefill_timeout_s == 1000.0 and cfg.served_model_name == "1e3x"
    assert yaml.safe_load("a: 1e3") == {"a": "1e3"}  # PyYAML's own loader is left as it is

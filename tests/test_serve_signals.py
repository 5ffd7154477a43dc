"""`flashpd serve` told to stop (SIGTERM) while its workers still start: it stops what it started and exits, and
no worker goes on loading without it (the signal handlers came only after the start, so SIGTERM killed serve
outright and left its workers loading, then serving nobody). Real processes on 127.0.0.1."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil

from tests._cluster_helpers import dflash_pair  # noqa: F401


def _start(pair, tmp_path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """`flashpd serve` (local mode, warm-up on) and its three workers, caught while the model workers load."""
    cfg = dict(target=str(pair.target_dir), draft=str(pair.draft_dir), mode="local", device="cpu",
               dtype="float32", kv_cache_tokens=4096, chunk_tokens=32, torch_threads=1, start_timeout_s=120.0,
               worker_metrics=False, warmup=True)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    p = subprocess.Popen([sys.executable, "-m", "flashpd.cli", "serve", str(tmp_path / "c.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    me = psutil.Process(p.pid)
    kids: list[psutil.Process] = []
    deadline = time.monotonic() + 60
    while len(kids) < 3 and time.monotonic() < deadline:  # bridge up, prefill and decode loading
        kids = [c for c in me.children(recursive=True) if "flashpd.cluster.worker_main" in " ".join(c.cmdline())]
        time.sleep(0.05)
    assert len(kids) == 3, "the workers did not start"
    return p, kids


def test_sigterm_while_workers_start_leaves_no_worker(dflash_pair, tmp_path):  # noqa: F811
    p, kids = _start(dflash_pair, tmp_path)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted" in err, (p.returncode, err[-500:])
    _, alive = psutil.wait_procs(kids, timeout=15)
    assert not alive, [c.pid for c in alive]


def test_a_starting_worker_whose_launcher_is_gone_exits():
    """SIGKILL of serve leaves no handler to run: a worker watches its launcher from its first second (the serving
    loop's own check comes only once it has loaded, minutes on a GPU). A parent pid that is gone: exit code 3."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = ("import threading, time; from flashpd.cluster.worker_main import _exit_if_orphaned_while_starting as w; "
            f"threading.Thread(target=w, args=({gone.pid}, threading.Event()), daemon=True).start(); time.sleep(60)")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert r.returncode == 3 and "is gone while this worker started" in r.stderr, (r.returncode, r.stderr[-300:])
    assert time.monotonic() - t0 < 50  # well before its 60 s of "loading"

"""The mixed-load benchmark (bench/pd_benefit.py): its statistics on hand-made data (ITL per token of a burst,
TPOT, SLO attainment, goodput, the P99 ITL ratio and the aim), its seeded Poisson workload, and one real run
on the CPU: the shipped demo pair served as 1P1D (device path) by a real local service, both methods at two
rates, every number checked against the per-request chunk times the JSON keeps; then --resume of the same
command, which must keep every row and start nothing."""
from __future__ import annotations

import argparse
import json
import os
import time

import pytest

from flashpd.bench import pd_benefit as pb


def _row(rate, att, p99=None, config="replicas", method="dflash"):
    return {"config": config, "method": method, "rate": rate, "slo_attainment": att,
            "itl_ms": {"p99": p99}}


def test_itl_splits_a_burst_evenly_over_its_tokens():
    # first chunk (TTFT) gives nothing; 10 ms then 1 token; 16 ms then a 4-token burst; 6 ms then 2 tokens
    assert pb.itl_samples([(100.0, 1), (110.0, 1), (126.0, 4), (132.0, 2)]) == [10.0, 4.0, 4.0, 4.0, 4.0, 3.0, 3.0]
    assert pb.itl_samples([(50.0, 3)]) == [] and pb.itl_samples([]) == []
    assert pb.tpot_ms(100.0, 400.0, 4) == 100.0 and pb.tpot_ms(100.0, 400.0, 1) is None
    assert pb.tpot_ms(None, 400.0, 4) is None


def test_percentiles_are_ordered_and_exact_on_known_data():
    p = pb.pcts([float(x) for x in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01) and p["max"] == 100.0
    assert p["p50"] <= p["p90"] <= p["p99"] <= p["max"] and p["n"] == 100
    assert pb.pcts([])["p99"] is None and pb.pcts([7.0])["p99"] == 7.0


def test_percentiles_never_decrease_where_interpolation_rounds_between_equal_values():
    """statistics.quantiles can interpolate between two equal values a unit in the last place off them (CPython
    3.11: on these values its p55 falls under its p54, its p54 over the largest value); a run's ITL p99 once came
    out under its p90."""
    from flashpd.bench.load_gen import centiles, percentiles

    s = [45.49961541408508, 50.04807362210215, 50.04807362210215]
    q = centiles(s)
    assert all(a <= b for a, b in zip(q, q[1:])) and q[-1] <= s[-1] and q[0] >= s[0]
    p = pb.pcts(s)
    assert p["p50"] <= p["p90"] <= p["p99"] <= p["max"] == s[-1]
    assert percentiles(s)["p50"] <= percentiles(s)["p95"] <= s[-1]


def test_slo_attainment_counts_errors_and_both_slos():
    def req(i, ttft, lat, tokens, error=None):
        r = pb.Req(i, 10, False, tokens, 0.0, error=error)
        if error is None:
            step = (lat - ttft) / max(tokens - 1, 1)
            r.chunks = [(ttft + j * step, 1) for j in range(tokens)]
            r.ttft_ms, r.latency_ms = ttft, lat
        return r

    reqs = [req(0, 100.0, 100.0 + 9 * 20.0, 10),   # TTFT 100, TPOT 20: meets both
            req(1, 900.0, 900.0 + 9 * 20.0, 10),   # TTFT over 500
            req(2, 100.0, 100.0 + 9 * 60.0, 10),   # TPOT 60, over 50
            req(3, 0.0, 0.0, 0, error="boom"),     # an error is a miss
            req(4, 200.0, 200.0, 1)]               # one token: no TPOT, TTFT within: meets
    s = pb.summarize_rate(reqs, 2.0, ttft_slo_ms=500.0, tpot_slo_ms=50.0)
    assert (s["requests"], s["errors"], s["slo_met"]) == (5, 1, 2) and s["slo_attainment"] == pytest.approx(0.4)
    assert s["tpot_ms"]["n"] == 3 and s["tpot_ms"]["max"] == pytest.approx(60.0)
    assert s["itl_ms"]["n"] == 27 and s["output_tokens"] == 31 and s["first_errors"] == ["boom"]
    assert s["output_tokens_per_s"] == pytest.approx(15.5)


def test_goodput_is_the_highest_rate_meeting_the_attainment():
    rows = [_row(1, 0.95), _row(2, 0.90), _row(4, 0.85), _row(8, 0.91), _row(16, 0.2)]
    assert pb.goodput(rows, 0.9) == 8  # the highest rate at which >= 90% met both SLOs
    assert pb.goodput(rows, 0.92) == 1
    assert pb.goodput([_row(1, 0.5), _row(2, 0.1)], 0.9) == 0 and pb.goodput([], 0.9) == 0


def test_p99_itl_ratio_is_taken_at_the_highest_rate_both_meet_and_the_aim():
    d = [_row(1, 1.0, 8.0, "1p1d-device"), _row(2, 0.95, 9.0, "1p1d-device"), _row(4, 0.92, 10.0, "1p1d-device")]
    r = [_row(1, 1.0, 20.0), _row(2, 0.91, 30.0), _row(4, 0.6, 80.0)]
    out = pb.itl_ratio(d, r, 0.9)
    assert out["rate"] == 2 and out["ratio"] == pytest.approx(9.0 / 30.0)
    assert pb.itl_ratio(d, [_row(1, 0.1, 5.0)], 0.9)["ratio"] is None
    native = [dict(x, method="native") for x in d + r]
    s = pb.summary(d + r + native + [_row(1, 1.0, 5.0, "colocated")], ["native", "dflash"], 0.9)
    assert s["goodput"] == {"1p1d-device": {"dflash": 4, "native": 4}, "replicas": {"dflash": 2, "native": 2},
                            "colocated": {"dflash": 1}}
    assert s["p99_itl_disagg_over_replicas"] == pytest.approx(0.3)
    assert s["p99_itl_disagg_over_replicas_method"] == "dflash"
    assert s["p99_itl_disagg_over_replicas_config"] == "1p1d-device"
    assert set(s["p99_itl_disagg_over_replicas_by_method"]) == {"native", "dflash"}
    assert s["aim"]["met"] is True and s["aim"]["goodput_no_lower"] is True
    worse = pb.summary([_row(1, 1.0, 25.0, "1p1d-device"), _row(1, 1.0, 20.0)], ["dflash"], 0.9)
    assert worse["p99_itl_disagg_over_replicas"] == pytest.approx(1.25) and worse["aim"]["met"] is False


def test_workload_is_seeded_mixed_and_poisson():
    a = pb.request_specs(2000, 4.0, 0, 0.25, (128, 512), (2048, 8192), (256, 256))
    assert a == pb.request_specs(2000, 4.0, 0, 0.25, (128, 512), (2048, 8192), (256, 256))
    assert a != pb.request_specs(2000, 4.0, 1, 0.25, (128, 512), (2048, 8192), (256, 256))
    assert sum(s.long for s in a) == 500
    assert all((2048 <= s.prompt_tokens <= 8192) if s.long else (128 <= s.prompt_tokens <= 512) for s in a)
    gaps = [y.arrival_s - x.arrival_s for x, y in zip(a, a[1:])]
    assert a[0].arrival_s == 0 and min(gaps) > 0
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        pb.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "--rates RATES Poisson arrival rates, requests/s (default: 1,2,4,8,16)" in text
    assert "TTFT SLO (default: 2000.0)" in text and "TPOT SLO (default: 30.0)" in text


SMALL = ["--rates", "4,8", "--requests", "4", "--short-tokens", "32", "--long-tokens", "96", "--long-fraction",
         "0.25", "--max-tokens", "6", "--warmup", "2", "--device", "cpu", "--dtype", "float32", "--kv-cache-tokens",
         "1024", "--torch-threads", "1", "--chunk-tokens", "32", "--start-timeout-s", "180", "--request-timeout-s",
         "60", "--ttft-slo-ms", "5000", "--tpot-slo-ms", "1000", "--per-request", "--methods", "native,dflash"]


def _itl_from_chunks(per_request: list[dict]) -> list[float]:
    """The documented rule, spelled out here apart from the module's: a chunk of k tokens g ms after the
    previous gives k samples g / k."""
    out = []
    for q in per_request:
        t, k = q["chunks_ms"], q["chunk_tokens"]
        for j in range(1, len(t)):
            out += [(t[j] - t[j - 1]) / k[j]] * k[j]
    return out


def test_runs_end_to_end_on_a_real_1p1d_service_and_resumes(tmp_path):
    out = tmp_path / "pd.json"
    argv = ["--out", str(out), "--configs", "1p1d-device", *SMALL]
    t = time.monotonic()
    assert pb.main(argv) == 0
    first = json.loads(out.read_text())
    d = first
    assert d["kind"] == "pd_benefit" and d["complete"] and not d["partial"] and d["git"] and d["machine"]
    assert d["gpus"]["device"] == "cpu" and d["gpus"]["count"] == 0
    assert d["gpus"]["placement"] == {"1p1d-device": {"prefill0": "cpu", "decode0": "cpu"}}
    assert d["settings"]["ttft_slo_ms"] == 5000 and d["settings"]["tpot_slo_ms"] == 1000
    assert d["settings"]["prompt_source"] == "held-out text"  # the demo pair has a tokenizer
    assert {(r["config"], r["method"], r["rate"]) for r in d["runs"]} == {
        ("1p1d-device", m, r) for m in ("native", "dflash") for r in (4, 8)}
    for r in d["runs"]:
        q = r["per_request"]
        assert r["errors"] == 0 and r["requests"] == 4 and r["output_tokens"] == 24, r["first_errors"]
        assert sum(x["long"] for x in q) == 1 and {x["prompt_tokens"] for x in q if x["long"]} == {96}
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
            p = r[k]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= p["max"], (k, p)
        assert r["output_tokens_per_s"] > 0 and r["wall_s"] > 0 and r["slo_attainment"] == 1.0
        for x in q:  # TPOT from the request's own times; every token arrived in some chunk
            assert sum(x["chunk_tokens"]) == x["output_tokens"] == 6 and x["ttft_ms"] == x["chunks_ms"][0]
            assert x["tpot_ms"] == pytest.approx((x["latency_ms"] - x["ttft_ms"]) / 5)
        itl = _itl_from_chunks(q)
        assert r["itl_ms"]["n"] == len(itl) == 24 - sum(x["chunk_tokens"][0] for x in q)
        assert r["itl_ms"]["max"] == pytest.approx(max(itl))
        assert r["itl_ms"]["mean"] == pytest.approx(sum(itl) / len(itl))
        assert (r["tau"] is None) == (r["method"] == "native")
        # the decode worker's own counters: every prompt's KV came over the device path, none recomputed
        dec = r["worker_counters"]["decode"]
        assert dec["flashpd_handoff_imports"] == 4 and dec["flashpd_handoff_fallbacks"] == 0, r["worker_counters"]
    # DFlash commits several tokens a step: its streams carry bursts, which the ITL splits per token
    assert sum(r["multi_token_chunks"] for r in d["runs"] if r["method"] == "dflash") > 0
    assert d["goodput"] == {"1p1d-device": {"native": 8, "dflash": 8}}
    assert d["p99_itl_disagg_over_replicas"] is None  # no replicas run here: nothing to divide by
    took = time.monotonic() - t
    # the same command again with --resume: every row kept, no service started
    t = time.monotonic()
    assert pb.main([*argv, "--resume"]) == 0
    again = json.loads(out.read_text())
    assert again["runs"] == first["runs"] and len(again["commands"]) == 2 and again["complete"]
    assert time.monotonic() - t < took / 2
    with pytest.raises(SystemExit, match="another workload"):
        pb.main([*argv, "--resume", "--tpot-slo-ms", "10"])


def test_one_gpu_restriction_sets_the_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    pb.restrict_gpus(1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    pb.restrict_gpus(1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    with pytest.raises(SystemExit):
        pb.restrict_gpus(4)
    a = argparse.Namespace(device="cpu", target="t", draft=None, config=None, dtype=None, kv_cache_tokens=None,
                           torch_threads=None, chunk_tokens=256, max_running=128)
    assert pb.gpu_info(a, ["colocated"])["placement"] == {"colocated": {"server": "cpu"}}


def test_a_time_budget_stops_before_a_start_and_says_partial(tmp_path):
    out = tmp_path / "budget.json"
    assert pb.main(["--out", str(out), "--configs", "colocated", *SMALL, "--time-budget-s", "1"]) == 3
    d = json.loads(out.read_text())
    assert d["partial"] and not d["complete"] and d["runs"] == [] and d["goodput"] == {}

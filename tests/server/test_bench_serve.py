"""bench_serve is bounded and stops by itself (small run on the tiny model)."""

import threading

from polykv.bench.serve import bench_serve

from ..engine._models import tiny_model


def test_bench_serve_small_run_is_clean():
    mt = tiny_model()  # loading may start tqdm's monitor thread: not ours
    before = {t for t in threading.enumerate() if t.is_alive()}
    res = bench_serve(n_clients=4, requests_per_client=2, max_tokens=4, _model_tok=mt, time_limit_s=120)
    assert res["requests"] == 8
    assert res["errors"] == 0 and res["lost"] == 0, res
    assert res["completed"] == 8 and res["req_per_s"] > 0 and res["latency_p99_s"] >= res["latency_p50_s"]
    assert res["completion_tokens"] <= 8 * 4
    assert {t for t in threading.enumerate() if t.is_alive()} <= before


def test_bench_serve_time_limit_counts_lost():
    res = bench_serve(n_clients=2, requests_per_client=50, max_tokens=4, _model_tok=tiny_model(), time_limit_s=1.0)
    assert res["completed"] + res["errors"] + res["lost"] == 100
    assert res["wall_s"] < 30

"""bench_serve is bounded and stops by itself (small run on the tiny model)."""

import threading

import pytest

from polykv.bench.serve import bench_serve

from ..engine._models import tiny_model


def test_bench_serve_small_run_is_clean():
    mt = tiny_model()  # loading may start tqdm's monitor thread: not ours
    before = {t for t in threading.enumerate() if t.is_alive()}
    res = bench_serve(n_clients=4, requests_per_client=2, max_tokens=4, _model_tok=mt, time_limit_s=120)
    assert res["requests"] == 8
    assert res["errors"] == 0 and res["lost"] == 0 and res["completed"] == 8, res
    # every request produced between 1 and max_tokens tokens, and the engine stepped for them
    assert 8 <= res["completion_tokens"] <= 8 * 4
    assert res["engine_steps"] >= res["completion_tokens"] / 8
    assert res["req_per_s"] == pytest.approx(8 / res["wall_s"], rel=0.01)
    assert 0 < res["ttft_p50_s"] <= res["latency_p50_s"] <= res["wall_s"]
    # the document is held once, compressed: fewer bytes than its f16 copy
    assert res["doc_tokens"] > 100 and 0 < res["kv_bytes_shared"] < res["kv_bytes_naive_f16"]
    assert {t for t in threading.enumerate() if t.is_alive()} <= before


def test_bench_serve_time_limit_counts_lost():
    """A load that cannot finish in the limit is cut at the limit: the unfinished requests are
    counted as lost (not errors), and the run returns soon after the deadline."""
    res = bench_serve(n_clients=2, requests_per_client=500, max_tokens=4, _model_tok=tiny_model(),
                      time_limit_s=1.0)
    assert res["requests"] == 1000 and res["errors"] == 0, res
    assert res["lost"] > 0 and res["completed"] < 1000
    assert 0.9 <= res["wall_s"] < 30

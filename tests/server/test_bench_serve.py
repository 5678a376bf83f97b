"""bench_serve is bounded and stops by itself (small run on the tiny model)."""

import threading
import time

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
    # no thread of ours outlives the run; anyio's idle thread-pool workers (starlette's sync calls)
    # exit by themselves within their 10 s idle timeout, so extra threads get that long to end
    deadline = time.monotonic() + 15
    while (extra := {t for t in threading.enumerate() if t.is_alive()} - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not extra, extra


def test_bench_serve_time_limit_counts_lost():
    """A load that cannot finish in the limit is cut at the limit: the unfinished requests are
    counted as lost (not errors), and the run returns soon after the deadline."""
    res = bench_serve(n_clients=2, requests_per_client=500, max_tokens=4, _model_tok=tiny_model(),
                      time_limit_s=1.0)
    assert res["requests"] == 1000 and res["errors"] == 0, res
    assert res["lost"] > 0 and res["completed"] < 1000
    assert 0.9 <= res["wall_s"] < 30


def test_bench_serve_mixed_load_counts_every_class():
    """Malformed and over-budget requests mixed into the streaming load: every malformed case gets its
    4xx, every over-budget document add a 429 with Retry-After, every good request completes."""
    res = bench_serve(n_clients=3, requests_per_client=10, max_tokens=3, _model_tok=tiny_model(), time_limit_s=120,
                      malformed=0.5, over_budget=0.2, seed=1)
    c = res["classes"]
    assert (c["good"]["planned"], c["malformed"]["planned"], c["over_budget"]["planned"]) == (30, 15, 6)
    assert res["requests"] == 30 and res["requests_total"] == 51
    assert res["completed"] == 30 and res["errors"] == 0 and res["lost_all"] == 0 and res["http_5xx"] == 0, res
    assert c["malformed"]["answered_4xx"] == c["malformed"]["as_expected"] == 15
    cases = c["malformed"]["by_case"]
    assert len(cases) == 14 and all(row["statuses"] and set(row["statuses"]) == {str(row["expected"])}
                                    for row in cases.values()), cases
    assert c["over_budget"]["answered_429"] == c["over_budget"]["with_retry_after"] == 6
    # the budget fits the document and the good load; the over-budget document alone does not fit
    assert res["budget_bytes"] > res["kv_bytes_shared"]
    assert c["over_budget"]["document_tokens"] > res["doc_tokens"]
    assert res["documents_after"] == 1  # no refused document stayed
    assert res["clean"] is True
    assert 30 <= res["completion_tokens"] <= 90


@pytest.mark.filterwarnings("ignore:polykv pool:UserWarning")  # the unenforced budget, on purpose
def test_bench_serve_detects_a_5xx_and_an_unenforced_budget(monkeypatch):
    """The counters can fail: a route that crashes on unknown documents is a 5xx, and a budget the
    server does not enforce leaves over-budget adds answered 200."""
    import importlib

    from polykv.engine import Engine
    from polykv.server.state import ServerState

    completions = importlib.import_module("polykv.server.routes.completions")  # the package exports the router

    def crash(state, doc_id, param="document"):
        if doc_id not in state.docs:
            raise RuntimeError("injected bug")
        return state.docs[doc_id]

    monkeypatch.setattr(completions, "lookup", crash)
    monkeypatch.setattr(ServerState, "refuse_unfittable", lambda self, text, name: None)
    monkeypatch.setattr(Engine, "check_budget", lambda self, what="", extra=0: None)
    res = bench_serve(n_clients=2, requests_per_client=7, max_tokens=2, _model_tok=tiny_model(), time_limit_s=120,
                      malformed=1.0, over_budget=0.15, seed=2)
    c = res["classes"]
    assert res["completed"] == 14 and res["clean"] is False
    assert res["http_5xx"] == c["malformed"]["statuses"].get("500", 0) >= 1
    assert c["malformed"]["by_case"]["unknown_document"]["statuses"] == {"500": 1}
    assert c["over_budget"]["planned"] == 2 and c["over_budget"]["answered_429"] == 0
    assert c["over_budget"]["statuses"] == {"200": 2} and res["documents_after"] == 2


def test_a_failed_ray_teardown_is_logged_not_raised():
    """bench serve --ray's measured rows stand when Serve's controller dies while shutting down."""
    from polykv.bench.serve import _teardown

    said = []

    def dies():
        raise RuntimeError("ActorDiedError()")

    _teardown(dies, said.append)
    assert len(said) == 1 and "ActorDiedError" in said[0] and "results stand" in said[0]
    _teardown(lambda: None, said.append)
    assert len(said) == 1

"""Residency tiers through the server: `polykv serve --gpu-budget / --host-budget` reach the pool (new
or loaded from the store), and the document listing and status show each document's tier."""

from __future__ import annotations

import httpx

from polykv.server import ServerThread, create_app
from polykv.server.runner import build_pool

from ..engine._models import tiny_model

TEXTS = ["The lighthouse keeper of Varnholm logged every ship that passed the northern cape. " * 2,
         "In the winter of 1911 the logbook records eleven ships, three of them whalers. " * 2]


def test_serve_flags_reach_the_runner(monkeypatch):
    from typer.testing import CliRunner

    import polykv.server
    from polykv.cli import app

    seen = {}
    monkeypatch.setattr(polykv.server, "serve", lambda **kw: seen.update(kw))
    res = CliRunner().invoke(app, ["serve", "--gpu-budget", "1000", "--host-budget", "5000"])
    assert res.exit_code == 0, res.output
    assert seen["budget_bytes"] == 1000 and seen["host_budget_bytes"] == 5000
    res = CliRunner().invoke(app, ["serve", "--budget-bytes", "700"])  # the old name still works
    assert res.exit_code == 0 and seen["budget_bytes"] == 700 and seen["host_budget_bytes"] is None
    res = CliRunner().invoke(app, ["serve", "--budget-bytes", "700", "--gpu-budget", "800"])
    assert res.exit_code != 0 and "--gpu-budget" in res.output


def test_build_pool_takes_both_budgets_new_and_loaded(tmp_path):
    model, tok = tiny_model()
    pool = build_pool(model, tok, budget_bytes=10**6, host_budget_bytes=2 * 10**6)
    assert (pool.gpu_budget_bytes, pool.host_budget_bytes) == (10**6, 2 * 10**6)
    doc = pool.add_document(TEXTS[0])
    one = pool.documents()[0]["bytes"]
    pool.save(tmp_path / "store")
    back = build_pool(model, tok, store=tmp_path / "store", budget_bytes=one // 2, host_budget_bytes=10 * one)
    assert (back.gpu_budget_bytes, back.host_budget_bytes) == (one // 2, 10 * one)
    assert {d["id"]: d["tier"] for d in back.documents()} == {doc: "host"}  # fitted at load


def test_document_listing_and_status_show_the_tier():
    model, tok = tiny_model()
    pool = build_pool(model, tok, host_budget_bytes=10**8)
    app = create_app(pool, model_name="tiny-test")
    with ServerThread(app) as srv:
        a = httpx.post(srv.url + "/v1/documents", json={"text": TEXTS[0]}, timeout=60).json()
        b = httpx.post(srv.url + "/v1/documents", json={"text": TEXTS[1]}, timeout=60).json()
        assert a["tier"] == b["tier"] == "gpu"
        app.state.polykv.engine.call(pool.move, b["id"], "host").result(timeout=60)
        listed = {d["id"]: d["tier"] for d in httpx.get(srv.url + "/v1/documents").json()["data"]}
        assert listed == {a["id"]: "gpu", b["id"]: "host"}
        assert httpx.get(srv.url + f"/v1/documents/{b['id']}").json()["tier"] == "host"
        status = httpx.get(srv.url + "/v1/status", timeout=30).json()
        assert {d["id"]: d["tier"] for d in status["documents"]} == listed
        mem = status["memory"]
        assert mem["kv_bytes_gpu"] + mem["kv_bytes_host"] == mem["kv_bytes_shared"] and mem["kv_bytes_host"] > 0


def test_server_admits_documents_the_host_tier_holds():
    model, tok = tiny_model()
    probe = build_pool(model, tok)
    probe.add_document(TEXTS[0])
    one = probe.documents()[0]["bytes"]
    pool = build_pool(model, tok, budget_bytes=int(one * 1.5), host_budget_bytes=10 * one)
    app = create_app(pool, model_name="tiny-test")
    with ServerThread(app) as srv:
        for text in TEXTS:
            r = httpx.post(srv.url + "/v1/documents", json={"text": text}, timeout=60)
            assert r.status_code == 200, r.text
        assert sorted(d["tier"] for d in httpx.get(srv.url + "/v1/documents").json()["data"]) == ["gpu", "host"]

"""A document add that cannot fit the KV budget is refused before its prefill (no stall of the other
streams, no eviction of the documents it could never replace); one that fits after evicting unused
documents, or one already resident, is still accepted."""

import httpx
import pytest

from polykv.server import ServerThread, create_app

from ..engine._models import make_pool
from .conftest import DOC_TEXT

OTHER = "A second memo: the ferry leaves the north pier at seven and returns at noon. " * 4
BIG = "The archive holds letters, maps, ledgers and photographs of the harbour, sorted by decade. " * 30


def _serve(tiny):
    model, tok = tiny
    pool = make_pool(model, tok)
    if not hasattr(pool, "_doc_tokens"):
        pytest.skip("the shared pool is not importable")
    app = create_app(pool, model_name="tiny-test")
    return pool, app


def test_prefix_bytes_is_the_measured_size(tiny):
    pool, app = _serve(tiny)
    state = app.state.polykv
    with ServerThread(app) as srv:
        for text in (DOC_TEXT, OTHER, BIG):
            d = httpx.post(srv.url + "/v1/documents", json={"text": text}, timeout=60).json()
            assert state.prefix_bytes(d["tokens"]) == d["bytes"] > 0


def test_unfittable_document_is_refused_before_prefill(tiny):
    pool, app = _serve(tiny)
    state = app.state.polykv
    prefills = []
    real = pool._prefill
    pool._prefill = lambda doc, *a, **kw: (prefills.append(doc.id), real(doc, *a, **kw))[1]
    with ServerThread(app) as srv:
        keep = httpx.post(srv.url + "/v1/documents", json={"text": DOC_TEXT}, timeout=60).json()
        other = httpx.post(srv.url + "/v1/documents", json={"text": OTHER}, timeout=60).json()
        assert len(prefills) == 2
        big_tokens = len(pool._doc_tokens(BIG)[0])
        # room for both small documents, not for BIG even with both evicted
        pool.budget_bytes = keep["bytes"] + other["bytes"] + state.prefix_bytes(big_tokens) // 2
        r = httpx.post(srv.url + "/v1/documents", json={"text": BIG, "name": "big"}, timeout=60)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "kv_budget_exceeded" and int(r.headers["retry-after"]) >= 1
        assert len(prefills) == 2, "refused after a prefill"
        rows = {d["id"]: d for d in pool.documents()}
        assert rows[keep["id"]]["resident"] and rows[other["id"]]["resident"], "a refused add evicted a document"
        assert {d["id"] for d in httpx.get(srv.url + "/v1/documents").json()["data"]} == {keep["id"], other["id"]}
        # a resident document added again costs nothing: accepted at the edge of the budget
        pool.budget_bytes = keep["bytes"] + other["bytes"]
        assert httpx.post(srv.url + "/v1/documents", json={"text": OTHER}, timeout=60).status_code == 200
        assert len(prefills) == 2
        # BIG fits once the unused documents are evicted: not refused by the early check
        pool.budget_bytes = state.prefix_bytes(big_tokens) + 1
        r = httpx.post(srv.url + "/v1/documents", json={"text": BIG}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(prefills) == 3
        assert httpx.get(srv.url + "/health").status_code == 200

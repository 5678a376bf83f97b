"""Every bad input is a 4xx in OpenAI's error shape; none disturbs other requests."""

import json
import threading
import time

import httpx
import pytest

from polykv.engine import Engine
from polykv.server import ServerThread, create_app

from ..engine._models import make_pool
from .conftest import DOC_TEXT


def _assert_error(r, status, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture(scope="module")
def doc_id(server):
    return httpx.post(server.url + "/v1/documents", json={"text": DOC_TEXT}).json()["id"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/documents"])
def test_malformed_json(server, path):
    r = httpx.post(server.url + path, content=b'{"prompt": "x", ', headers={"content-type": "application/json"})
    _assert_error(r, 400, "invalid_json")


@pytest.mark.parametrize("body,param", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 3.5}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": "x", "document": 12}, "document"),
    ({}, "prompt"),
    ([1, 2, 3], None),
])
def test_wrong_types_are_400(server, body, param):
    err = _assert_error(httpx.post(server.url + "/v1/completions", json=body), 400)
    if param:
        assert err["param"].split(".")[0] == param


@pytest.mark.parametrize("body,code", [
    ({"prompt": "x", "max_tokens": 0}, "invalid_value"),
    ({"prompt": "x", "max_tokens": -4}, "invalid_value"),
    ({"prompt": "x", "max_tokens": 10**9}, "invalid_value"),
    ({"prompt": "x", "n": 3}, "unsupported_value"),
    ({"prompt": "", "max_tokens": 2}, "invalid_value"),
    ({"prompt": ["a", "b"]}, "unsupported_value"),
    ({"prompt": [10**9]}, "invalid_value"),
    ({"prompt": "x", "model": "gpt-9"}, "model_not_found"),
    ({"prompt": "x", "document": "nope"}, "document_not_found"),
    ({"prompt": "x", "stop": [""]}, "invalid_value"),
    ({"prompt": "x", "logprobs": 3}, "unsupported_value"),
])
def test_bad_values(server, body, code):
    r = httpx.post(server.url + "/v1/completions", json=body)
    status = 404 if code in ("model_not_found", "document_not_found") else 400
    _assert_error(r, status, code)


def test_prompt_over_context(server, tiny, doc_id):
    model, tok = tiny
    ctx = model.config.max_position_embeddings
    r = httpx.post(server.url + "/v1/completions", json={"prompt": list(range(100, 100 + ctx)), "max_tokens": 1})
    _assert_error(r, 400, "context_length_exceeded")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": ctx - 5, "document": doc_id})
    _assert_error(r, 400, "context_length_exceeded")
    r = httpx.post(server.url + "/v1/documents", json={"text": "word " * (ctx + 10)})
    _assert_error(r, 400, "context_length_exceeded")


def test_chat_errors(server):
    _assert_error(httpx.post(server.url + "/v1/chat/completions", json={"messages": []}), 400)
    _assert_error(httpx.post(server.url + "/v1/chat/completions",
                             json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    _assert_error(httpx.post(server.url + "/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}), 400)


def test_unknown_route_and_method(server):
    _assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    _assert_error(httpx.put(server.url + "/v1/completions", json={}), 405)
    _assert_error(httpx.delete(server.url + "/v1/documents/nope"), 404, "document_not_found")


def test_bad_requests_do_not_disturb_others(server, doc_id):
    good = {}

    def run_good():
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": "Ships", "max_tokens": 12, "temperature": 0, "document": doc_id})
        good["r"] = r

    t = threading.Thread(target=run_good)
    t.start()
    for body in ({"prompt": 5}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "document": "nope"}):
        assert httpx.post(server.url + "/v1/completions", json=body).status_code in (400, 404)
    t.join(60)
    assert good["r"].status_code == 200 and good["r"].json()["usage"]["completion_tokens"] >= 1


def test_delete_in_use_is_409(server):
    d = httpx.post(server.url + "/v1/documents", json={"text": DOC_TEXT + " in use"}).json()
    body = {"prompt": "long", "max_tokens": 400, "temperature": 0, "stream": True, "document": d["id"],
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # keep the iterator alive: dropping it closes the connection
        first = next(lines)
        assert first.startswith("data: {"), first
        _assert_error(httpx.delete(server.url + f"/v1/documents/{d['id']}"), 409, "document_in_use")
    deadline = time.time() + 20
    while time.time() < deadline:
        r = httpx.delete(server.url + f"/v1/documents/{d['id']}")
        if r.status_code == 200:
            break
        time.sleep(0.1)
    assert r.status_code == 200


def test_budget_exceeded_is_429(tiny):
    model, tok = tiny
    pool = make_pool(model, tok, budget_bytes=1)
    app = create_app(pool, model_name="tiny-test")
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + "/v1/documents", json={"text": DOC_TEXT}, timeout=60)
        err = _assert_error(r, 429, "kv_budget_exceeded")
        assert err["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
        # the server stays healthy
        assert httpx.get(srv.url + "/health").status_code == 200


def test_queue_full_is_429(tiny):
    model, tok = tiny
    eng = Engine(make_pool(model, tok), max_waiting=0)
    app = create_app(eng, model_name="tiny-test")
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        _assert_error(r, 429, "queue_full")
        assert "retry-after" in r.headers


@pytest.mark.parametrize("path,body,param,words", [
    # a union-typed field is one problem of the field, told by the member of the value's own type
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature", "valid integer or a valid number"),
    ("/v1/completions", {"prompt": "x", "speculative": 5}, "speculative", "string or a valid dictionary"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type", "'text'"),
    # a lone UTF-16 surrogate is no text a tokenizer takes
    ("/v1/completions", {"prompt": "\ud800 hi"}, "prompt", "lone surrogate"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "\udfff"]}, "stop.1", "lone surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages.0.content",
     "lone surrogate"),
    ("/v1/documents", {"text": "abc \ud800 def"}, "text", "unicode string"),  # pydantic's own check (min_length)
])
def test_validation_names_the_field_and_the_problem(server, doc_id, path, body, param, words):
    raw = json.dumps(body)  # ASCII: a lone surrogate travels as its "\\ud800" escape, as a client sends it
    err = _assert_error(httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}),
                        400, "invalid_value")
    assert err["param"] == param, err
    assert words in err["message"] and ".str" not in err["message"] and "Value error" not in err["message"], err
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_top_k_beyond_any_vocabulary_is_off(server, doc_id):
    base = {"prompt": "Ships", "max_tokens": 4, "temperature": 0.8, "seed": 3, "document": doc_id}
    off = httpx.post(server.url + "/v1/completions", json=dict(base, top_k=0))
    for k in (2**63, 2**70):
        r = httpx.post(server.url + "/v1/completions", json=dict(base, top_k=k))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]


@pytest.mark.parametrize("body,words", [
    ({"speculative": {"method": "medusa"}}, "unknown speculative method"),
    ({"speculative": "prompt_lookup:abc"}, "must be an integer"),
    ({"speculative": "draft_model"}, "not available over HTTP"),
    ({"speculative": {"method": "prompt_lookup"}}, "give `document`"),
])
def test_speculative_without_a_document_is_checked(server, body, words):
    err = _assert_error(httpx.post(server.url + "/v1/completions", json=dict(body, prompt="x", max_tokens=2)),
                        400, "invalid_value")
    assert err["param"] == "speculative" and words in err["message"], err
    assert "draft_model" not in err["message"].replace("the draft_model method", ""), err  # not offered over HTTP


def test_agent_pages_count_at_admission(tiny):
    """A request whose own suffix pages would take the pool over its budget is refused at admission
    (the pages are allocated only at its first step); one that fits is served."""
    model, tok = tiny
    probe = make_pool(model, tok)
    if not hasattr(probe, "_doc_tokens"):
        pytest.skip("the shared pool is not importable")
    doc = probe.add_document(DOC_TEXT)
    batch = probe.open_batch(doc)
    need = batch.growth_bytes([3 + 64])  # a 3-token prompt + 64 new tokens
    batch.close()
    held = probe.memory_report()["kv_bytes_shared"]
    assert need > 0
    for budget, status in ((held + need // 2, 429), (held + need + 4096, 200)):
        pool = make_pool(model, tok, budget_bytes=budget)
        app = create_app(pool, model_name="tiny-test")
        with ServerThread(app) as srv:
            d = httpx.post(srv.url + "/v1/documents", json={"text": DOC_TEXT}, timeout=60)
            assert d.status_code == 200, d.text
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 64, "document":
                                                               d.json()["id"], "temperature": 0}, timeout=120)
            assert r.status_code == status, (budget, held, need, r.text)
            if status == 429:
                assert r.json()["error"]["code"] == "kv_budget_exceeded"

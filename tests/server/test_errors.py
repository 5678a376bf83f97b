"""Every bad input is a 4xx in OpenAI's error shape; none disturbs other requests."""

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

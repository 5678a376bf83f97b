"""Serving you can trust: a bug is a generic 500 with a request id (never internal text, never a
4xx in disguise), one request's failure leaves its neighbours alone, inputs are bounded (413, KV
budget 429), tokenization stays off the event loop, memory figures say which are computed."""

import logging
import threading
import time

import httpx
import pytest

from polykv.engine import DenseBatch, Engine
from polykv.server import ServerThread, create_app

from ..engine._faults import POISON, FaultyBatch, FaultyPool
from ..engine._models import make_pool
from .conftest import DOC_TEXT


def _internal(r):
    assert r.status_code == 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "internal_error" and err["type"] == "server_error"
    rid = r.headers["x-request-id"]
    assert rid in err["message"]
    return err, rid


class _BrokenPromptPool:
    """A pool whose prompt_ids has a bug (an exception no table knows)."""

    def __init__(self, inner):
        self.__dict__["inner"] = inner

    def prompt_ids(self, doc, text, *a, **k):
        raise RuntimeError("secret internal detail /srv/polykv/pool.py")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_bug_is_generic_500_with_request_id(tiny, caplog):
    model, tok = tiny
    app = create_app(_BrokenPromptPool(make_pool(model, tok)), model_name="tiny-test")
    with ServerThread(app) as srv, caplog.at_level(logging.ERROR, logger="polykv.server"):
        doc = httpx.post(srv.url + "/v1/documents", json={"text": DOC_TEXT}, timeout=60).json()["id"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Ships", "document": doc, "max_tokens": 2})
        err, rid = _internal(r)
        assert "secret" not in r.text and "RuntimeError" not in r.text
        logged = [rec for rec in caplog.records if rid in rec.getMessage()]
        assert logged and logged[0].exc_info is not None and "secret internal detail" in logged[0].getMessage()
        # a client's own request id is kept
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Ships", "document": doc},
                       headers={"X-Request-ID": "client-42"})
        assert _internal(r)[1] == "client-42"
        assert httpx.get(srv.url + "/health").status_code == 200


def test_failing_request_among_good_ones_over_http(tiny):
    """A request whose input makes the engine step fail gets a generic 500; the good requests in
    the same batch (streaming and not) all complete."""
    model, tok = tiny
    pool = make_pool(model, tok)
    eng = Engine(FaultyPool(pool), model=model, tok=tok, plain_batch_factory=lambda: FaultyBatch(DenseBatch(model)))
    with ServerThread(create_app(eng, model_name="tiny-test")) as srv:
        doc = httpx.post(srv.url + "/v1/documents", json={"text": DOC_TEXT}, timeout=60).json()["id"]
        good_ids = tok("Ships in winter", add_special_tokens=False)["input_ids"]
        out = {}

        def go(key, prompt, stream, document):
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": stream}
            if document:
                body["document"] = doc
            if stream:
                with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                    out[key] = (r.status_code, [ln for ln in r.iter_lines() if ln])
            else:
                r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
                out[key] = (r.status_code, r)

        eng.call(time.sleep, 0.3)  # hold the loop: everything below joins in one step
        jobs = [("bad-doc", good_ids[:2] + [POISON], False, True), ("bad-plain", [POISON, 5], False, False)]
        jobs += [(f"good-{i}", f"Ship {i} in winter", i % 2 == 0, i < 3) for i in range(5)]
        ts = [threading.Thread(target=go, args=j) for j in jobs]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        for key in ("bad-doc", "bad-plain"):
            _internal(out[key][1])
        for i in range(5):
            status, res = out[f"good-{i}"]
            assert status == 200, (i, res)
            if i % 2 == 0:
                assert res[-1] == "data: [DONE]" and '"finish_reason": "length"' in res[-2], res
            else:
                assert res.json()["usage"]["completion_tokens"] == 6
        assert eng.step_failures >= 2 and eng.running


def test_body_over_limit_is_413(tiny):
    model, tok = tiny
    app = create_app(make_pool(model, tok), model_name="tiny-test", max_body_bytes=2000)
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + "/v1/documents", json={"text": "x " * 1500})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

        def chunks():  # no Content-Length: the limit holds while reading
            for _ in range(5):
                yield b" " * 1000
            yield b'{"prompt": "hi"}'

        r = httpx.post(srv.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text

        def small():
            yield b'{"prompt": "hi", '
            yield b'"max_tokens": 2}'

        r = httpx.post(srv.url + "/v1/completions", content=small(), headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/v1/documents", json={"text": DOC_TEXT}, timeout=60)
        assert r.status_code == 200, r.text


class _SlowTok:
    """SmolLM2's tokenizer, but encoding a text that holds SLOW takes a while."""

    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    def __call__(self, text, *a, **k):
        if isinstance(text, str) and "SLOW" in text:
            time.sleep(self.delay)
        return self.inner(text, *a, **k)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_tokenization_does_not_block_the_event_loop(tiny):
    model, tok = tiny
    eng = Engine(make_pool(model, tok), tok=_SlowTok(tok, 1.5))
    with ServerThread(create_app(eng, model_name="tiny-test")) as srv:
        res = {}
        t = threading.Thread(target=lambda: res.update(r=httpx.post(
            srv.url + "/v1/completions", json={"prompt": "SLOW prompt", "max_tokens": 2}, timeout=60)))
        t.start()
        time.sleep(0.3)  # the request is being tokenized now
        t0 = time.perf_counter()
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        waited = time.perf_counter() - t0
        t.join(60)
        assert res["r"].status_code == 200
        assert waited < 0.6, f"/health waited {waited:.2f} s behind a tokenization"


def test_admission_over_kv_budget_is_429(tiny):
    """The budget counts agent storage, up to what each admitted agent may hold (prompt +
    max_tokens): with room for the document and one such agent, a second is refused (429 +
    Retry-After) while the first runs, and served once it finished."""
    model, tok = tiny
    pool = make_pool(model, tok)
    with ServerThread(create_app(pool, model_name="tiny-test")) as srv:
        doc = httpx.post(srv.url + "/v1/documents", json={"text": DOC_TEXT}, timeout=60).json()["id"]
        prompt = "Ships"
        ids = pool.prompt_ids(doc, prompt)
        eng = srv.config.app.state.polykv.engine
        rows = len(ids) + 300

        def measure():  # the batch the engine opens next (a closed one is parked and taken over)
            with pool.open_batch(doc) as b:
                b.add(ids)
                b.step()
            with pool.open_batch(doc) as b:
                return b.nbytes(), b.growth_bytes([rows]), b.growth_bytes([rows, rows])

        held, one, two = eng.call(measure).result(60)
        assert two > one
        pool.budget_bytes = pool.memory_report()["kv_bytes_shared"] + held + one
        body = {"prompt": prompt, "document": doc, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            r2 = httpx.post(srv.url + "/v1/completions", json=dict(body, stream=False), timeout=60)
            assert r2.status_code == 429, r2.text
            assert r2.json()["error"]["code"] == "kv_budget_exceeded" and int(r2.headers["retry-after"]) >= 1
        deadline = time.time() + 20
        while eng.live_agents() and time.time() < deadline:
            time.sleep(0.05)
        r3 = httpx.post(srv.url + "/v1/completions", json=dict(body, stream=False, max_tokens=2), timeout=60)
        assert r3.status_code == 200, r3.text


def test_computed_memory_figures_are_labelled(server):
    doc = httpx.post(server.url + "/v1/documents", json={"text": DOC_TEXT}, timeout=60).json()["id"]
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "document": doc}, timeout=60)
    m = httpx.get(server.url + "/metrics").text
    helps = {ln.split()[2]: ln for ln in m.splitlines() if ln.startswith("# HELP")}
    assert "measured" in helps["polykv_kv_bytes"] and "naive_agents" not in helps["polykv_kv_bytes"]
    assert 'polykv_kv_bytes{kind="naive_agents"}' not in m
    assert "computed" in helps["polykv_kv_bytes_computed"] and 'polykv_kv_bytes_computed{kind="naive_agents"}' in m
    mem = httpx.get(server.url + "/v1/status").json()["memory"]
    assert set(mem["computed"]) == {"kv_bytes_naive_f16_agents", "ratio_live"}

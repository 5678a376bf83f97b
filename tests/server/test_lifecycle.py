"""Clean shutdown (no orphan threads) and persistence across restart with a store directory."""

import threading
import time

import httpx
import pytest

from polykv.server import ServerThread, build_pool, create_app

from ..engine._models import make_pool
from .conftest import DOC_TEXT


def _threads():
    return {t for t in threading.enumerate() if t.is_alive()}


def test_clean_shutdown_joins_everything(tiny):
    model, tok = tiny
    before = _threads()
    app = create_app(make_pool(model, tok), model_name="tiny-test")
    srv = ServerThread(app).start()
    d = httpx.post(srv.url + "/v1/documents", json={"text": DOC_TEXT}).json()
    # leave a request running mid-stream while shutting down
    body = {"prompt": "go", "max_tokens": 500, "temperature": 0, "stream": True, "document": d["id"],
            "ignore_eos": True}
    res = {}

    def stream():
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                res["n"] = sum(1 for _ in r.iter_lines())
        except httpx.HTTPError as exc:
            res["err"] = exc

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    engine = app.state.polykv.engine
    assert engine.running
    t0 = time.time()
    srv.stop()
    t.join(30)
    assert time.time() - t0 < 20
    assert not engine.running
    assert not srv.thread.is_alive()
    time.sleep(0.2)
    leftover = {t for t in _threads() - before}
    assert not leftover, leftover


def test_documents_persist_across_restart(tiny, tmp_path):
    model, tok = tiny
    store = tmp_path / "store"
    store.mkdir()
    pool = build_pool(model, tok, store=store)
    app = create_app(pool, model_name="tiny-test", store=str(store))
    with ServerThread(app) as srv:
        d = httpx.post(srv.url + "/v1/documents", json={"text": DOC_TEXT, "name": "kept"}).json()
        r1 = httpx.post(srv.url + "/v1/completions", timeout=60,
                        json={"prompt": "Ships", "max_tokens": 6, "temperature": 0, "document": d["id"]}).json()
        gone = httpx.post(srv.url + "/v1/documents", json={"text": "removed before restart"}).json()
        assert httpx.delete(srv.url + f"/v1/documents/{gone['id']}").status_code == 200
    pool2 = build_pool(model, tok, store=store)
    app2 = create_app(pool2, model_name="tiny-test", store=str(store))
    with ServerThread(app2) as srv:
        docs = httpx.get(srv.url + "/v1/documents").json()["data"]
        assert [(x["id"], x["name"], x["tokens"]) for x in docs] == [(d["id"], "kept", d["tokens"])]
        r2 = httpx.post(srv.url + "/v1/completions", timeout=60,
                        json={"prompt": "Ships", "max_tokens": 6, "temperature": 0, "document": d["id"]}).json()
        assert r2["choices"][0]["text"] == r1["choices"][0]["text"]


def _wait_health(url, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("server did not come up")


@pytest.mark.model
def test_serve_process_store_and_sigint(tmp_path):
    """`serve(...)` in its own process: --store persists documents across a restart; SIGINT exits 0."""
    import signal
    import subprocess
    import sys

    from polykv.server import free_port

    from ..engine._models import real_model

    real_model()  # skip when the embedded model is not installed; also warms the converted cache
    store = tmp_path / "store"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    code = f"from polykv.server import serve; serve(port={port}, store={str(store)!r}, log_level='warning')"

    def start():
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    p = start()
    try:
        _wait_health(url, p)
        d = httpx.post(url + "/v1/documents", json={"text": DOC_TEXT, "name": "persisted"}, timeout=120).json()
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
    p = start()
    try:
        _wait_health(url, p)
        docs = httpx.get(url + "/v1/documents").json()["data"]
        assert [(x["id"], x["name"]) for x in docs] == [(d["id"], "persisted")]
        r = httpx.post(url + "/v1/chat/completions", timeout=300,
                       json={"messages": [{"role": "user", "content": "How many ships?"}], "max_tokens": 4,
                             "document": d["id"]})
        assert r.status_code == 200, r.text
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()

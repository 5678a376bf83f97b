"""`polykv serve --ray` on a local Ray instance (2 CPUs, 2 replicas of the embedded SmolLM2 on CPU).

One application for the whole module (starting Ray, Serve and two model replicas takes ~30 s on
two cores); the tests run in file order and the two replica kills come last. A test takes the
documents earlier tests added through `_ensure`, which adds them again to a cluster that
pytest-xdist rebuilt between two batches of this group. Every test is in the
xdist group "ray" (`make test` runs `--dist loadgroup`), so one worker owns the Ray instance.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.model]

DOC_A = ("The lighthouse keeper of Varnholm logged every ship that passed the northern cape. In the winter "
         "of 1911 the logbook records eleven ships, three of them whalers. ") * 4
DOC_B = ("Harbor Street library memo: the reading room opens at nine and closes at six; members may borrow up "
         "to six books for three weeks. ") * 4
MAX_ONGOING = 4  # per replica: 16 concurrent requests over one document saturate its holder


def _chat(doc: str, q: str = "How many ships passed?", **kw) -> dict:
    return {"document": doc, "messages": [{"role": "user", "content": q}], "max_tokens": 3, "temperature": 0, **kw}


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from polykv.ray import build_app, start_serve
    from polykv.ray.app import PROXY_READY_ENV, PROXY_READY_S
    from polykv.server import free_port

    os.environ.setdefault(PROXY_READY_ENV, PROXY_READY_S)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        port = free_port()
        start_serve({"host": "127.0.0.1", "port": port})
        serve.run(build_app(replicas=2, cpus_per_replica=1, max_ongoing_requests=MAX_ONGOING), name="polykv",
                  route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        health = _wait(url, lambda h: len(h["replicas"]) == 2, 120)
        yield {"url": url, "replicas0": {r["replica"] for r in health["replicas"]}, "docs": {}}
    finally:
        serve.shutdown()
        ray.shutdown()


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def _wait(url: str, cond, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            h = _health(url)
            if cond(h):
                return h
        except (httpx.HTTPError, ValueError, KeyError):
            h = None
        assert time.monotonic() < deadline, f"condition not met within {timeout} s; last /health: {h}"
        time.sleep(0.25)


def _holders(h: dict, doc: str) -> set[str]:
    return {r["replica"] for r in h["replicas"] if doc in r["documents"]}


def _add(cluster, name: str, text: str) -> tuple[str, str]:
    r = httpx.post(cluster["url"] + "/v1/documents", json={"text": text, "name": name}, timeout=300)
    assert r.status_code == 200, r.text
    doc, rep = r.json()["id"], r.headers["x-polykv-replica"]
    # /health and Serve's router learn the holder from the replica's reports
    _wait(cluster["url"], lambda h: rep in _holders(h, doc), 30)
    time.sleep(0.5)
    cluster["docs"][name] = (doc, rep)
    return doc, rep


def _ensure(cluster, name: str, text: str) -> tuple[str, str]:
    """The document an earlier test added, or add it now: pytest-xdist may tear the module's cluster
    down between two batches of this group and build a fresh one (seen in `make test`)."""
    return cluster["docs"].get(name) or _add(cluster, name, text)


async def _many(url: str, bodies: list[dict], path: str = "/v1/chat/completions") -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        return await asyncio.gather(*(c.post(path, json=b) for b in bodies))


def test_health_lists_replicas_and_their_documents(cluster):
    h = _health(cluster["url"])
    assert h["status"] == "ok" and len(h["replicas"]) == 2
    for r in h["replicas"]:
        assert r["engine_running"] and r["torch_threads"] == 1 and r["actor"].startswith("SERVE_REPLICA::")
        assert isinstance(r["documents"], list)
    doc, rep = _add(cluster, "a", DOC_A)
    h = _health(cluster["url"])
    assert _holders(h, doc) == {rep} and h["documents"] == 1 and h["prefills"] == 1
    listed = httpx.get(cluster["url"] + "/v1/documents", timeout=30).json()["data"]
    assert [(d["id"], d["replicas"]) for d in listed] == [(doc, [rep])] and listed[0]["bytes"] > 0


def test_same_api_as_polykv_serve(cluster):
    """Answers come from the replica's `polykv.server` app: the OpenAI shapes and error codes."""
    url, (doc, _) = cluster["url"], _ensure(cluster, "a", DOC_A)
    r = httpx.post(url + "/v1/completions", json={"document": doc, "prompt": "How many?", "max_tokens": 2,
                                                   "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["object"] == "text_completion" and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "smollm2-135m"
    with httpx.stream("POST", url + "/v1/chat/completions", json=_chat(doc, stream=True), timeout=120) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert s.status_code == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"
    cases = [  # (path, body, status, code)
        ("/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
        ("/v1/chat/completions", json.dumps(_chat("doc-0000000000000000")).encode(), 404, "document_not_found"),
        ("/v1/chat/completions", json.dumps(_chat(doc, n=2)).encode(), 400, "unsupported_value"),
        ("/v1/chat/completions", json.dumps(_chat(doc, model="gpt-9")).encode(), 404, "model_not_found"),
        ("/v1/chat/completions", json.dumps(_chat(doc, max_tokens=0)).encode(), 400, "invalid_value"),
        ("/v1/documents", b'{"text": 42}', 400, "invalid_value"),
    ]
    for path, body, status, code in cases:
        r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (path, body, r.text)
    assert httpx.get(url + "/v1/nowhere", timeout=30).status_code == 404
    assert httpx.get(url + "/v1/documents/doc-0000000000000000", timeout=30).status_code == 404


def test_affinity_requests_go_to_the_replica_holding_the_document(cluster):
    doc_a, rep_a = _ensure(cluster, "a", DOC_A)
    doc_b, rep_b = _add(cluster, "b", DOC_B)
    assert rep_b != rep_a, "a new document goes to the replica with the fewest documents"
    for doc, rep in ((doc_a, rep_a), (doc_b, rep_b)):
        for _ in range(3):  # sequential: never saturated, always the holder
            r = httpx.post(cluster["url"] + "/v1/chat/completions", json=_chat(doc), timeout=120)
            assert r.status_code == 200 and r.headers["x-polykv-replica"] == rep, r.text
    h = _health(cluster["url"])
    assert h["prefills"] == 2 and h["loads"] == 0  # no replica loaded a document it was not asked for


@pytest.mark.slow
def test_hot_document_spreads_to_a_second_replica_without_a_second_prefill(cluster):
    doc_a, rep_a = _ensure(cluster, "a", DOC_A)
    before = _health(cluster["url"])
    responses = asyncio.run(_many(cluster["url"], [_chat(doc_a, q=f"Question {i}?") for i in range(16)]))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    served = {r.headers["x-polykv-replica"] for r in responses}
    assert len(served) == 2, f"16 concurrent requests over one document stayed on {served}"
    h = _wait(cluster["url"], lambda h: len(_holders(h, doc_a)) == 2, 30)
    assert h["prefills"] == before["prefills"], "the second replica prefilled the document again"
    other = next(r for r in h["replicas"] if r["replica"] != rep_a)
    other_before = next(r for r in before["replicas"] if r["replica"] == other["replica"])
    assert other["loads"] >= 1 and other["prefills"] == other_before["prefills"]  # loaded, not prefilled
    # the same text added again through the cluster: found, not prefilled anywhere
    r = httpx.post(cluster["url"] + "/v1/documents", json={"text": DOC_A}, timeout=120)
    assert r.status_code == 200 and r.json()["id"] == doc_a
    assert _health(cluster["url"])["prefills"] == before["prefills"]


def test_delete_refused_in_use_then_dropped_everywhere(cluster):
    url = cluster["url"]
    doc, _ = _add(cluster, "c", "A short note about the tide tables of the northern harbour. " * 3)
    with httpx.stream("POST", url + "/v1/chat/completions",
                      json=_chat(doc, stream=True, max_tokens=200, ignore_eos=True), timeout=120) as s:
        events = (ln for ln in s.iter_lines() if ln.startswith("data: "))  # kept: dropping it closes the stream
        next(events)
        assert httpx.get(url + f"/v1/documents/{doc}", timeout=30).json()["agents"] == 1
        r = httpx.delete(url + f"/v1/documents/{doc}", timeout=30)
        assert r.status_code == 409 and r.json()["error"]["code"] == "document_in_use"
    deadline = time.monotonic() + 30
    while (r := httpx.delete(url + f"/v1/documents/{doc}", timeout=30)).status_code == 409:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert r.status_code == 200 and r.json()["deleted"] is True
    _wait(url, lambda h: not _holders(h, doc), 30)
    r = httpx.post(url + "/v1/chat/completions", json=_chat(doc), timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "document_not_found"


def _kill(cluster, replica_id: str) -> None:
    from ray import serve  # noqa: F401 - the replica actors live in Serve's namespace

    actor = next(r["actor"] for r in _health(cluster["url"])["replicas"] if r["replica"] == replica_id)
    ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)


@pytest.mark.slow
def test_replica_killed_under_load_loses_no_request_and_is_replaced(cluster):
    url = cluster["url"]
    doc_a, _ = _ensure(cluster, "a", DOC_A)
    doc_b, _ = _ensure(cluster, "b", DOC_B)
    victim = sorted(cluster["replicas0"])[0]
    bodies = [_chat(doc_a if i % 2 else doc_b, q=f"Question {i}?", max_tokens=4) for i in range(32)]

    async def load_and_kill():
        task = asyncio.ensure_future(_many(url, bodies))
        await asyncio.sleep(1.5)  # requests are in flight on both replicas
        await asyncio.to_thread(_kill, cluster, victim)
        return await task

    responses = asyncio.run(load_and_kill())
    assert [r.status_code for r in responses] == [200] * 32, [r.text for r in responses if r.status_code != 200]
    assert all(r.json()["choices"][0]["finish_reason"] in ("stop", "length") for r in responses)
    h = _health(url)
    assert h["retries"] >= 1, "no request was in flight on the killed replica"
    h = _wait(url, lambda h: len(h["replicas"]) == 2 and victim not in {r["replica"] for r in h["replicas"]}, 120)
    assert h["status"] == "ok"


@pytest.mark.slow
def test_stream_cut_by_a_dead_replica_ends_with_an_error_event(cluster):
    doc_a, _ = _ensure(cluster, "a", DOC_A)
    url = cluster["url"]
    with httpx.stream("POST", url + "/v1/chat/completions",
                      json=_chat(doc_a, stream=True, max_tokens=400, ignore_eos=True), timeout=120) as s:
        it = (ln for ln in s.iter_lines() if ln.startswith("data: "))
        got = [next(it), next(it), next(it)]
        _kill(cluster, s.headers["x-polykv-replica"])
        got += list(it)
    assert got[-1] == "data: [DONE]"
    err = json.loads(got[-2][6:])
    assert err["error"]["code"] == "replica_failed" and err["error"]["type"] == "server_error"
    assert len(got) < 400, "the stream ran to its end: the replica was not killed in time"

"""OpenAI client and raw HTTP against a live uvicorn on 127.0.0.1 (tiny random model)."""

import json
import threading

import httpx
import openai
import pytest

from .conftest import DOC_TEXT


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def doc(server):
    r = httpx.post(server.url + "/v1/documents", json={"text": DOC_TEXT, "name": "lighthouse"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_documents_crud(server, doc):
    assert doc["name"] == "lighthouse" and doc["tokens"] > 50 and doc["bytes"] > 0
    lst = httpx.get(server.url + "/v1/documents").json()
    assert doc["id"] in [d["id"] for d in lst["data"]]
    one = httpx.get(server.url + f"/v1/documents/{doc['id']}").json()
    assert one["id"] == doc["id"] and one["tokens"] == doc["tokens"]
    tmp = httpx.post(server.url + "/v1/documents", json={"text": "short lived document"}).json()
    r = httpx.delete(server.url + f"/v1/documents/{tmp['id']}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    r = httpx.get(server.url + f"/v1/documents/{tmp['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "document_not_found"


def test_completions_with_document(client, doc):
    r = client.completions.create(model="tiny-test", prompt="Ships:", max_tokens=5, temperature=0,
                                  extra_body={"document": doc["id"]})
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 5 and r.usage.prompt_tokens > 0
    again = client.completions.create(model="tiny-test", prompt="Ships:", max_tokens=5, temperature=0,
                                      extra_body={"document": doc["id"]})
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic


def test_completions_plain_and_streaming(client):
    full = client.completions.create(model="tiny-test", prompt="Hello world", max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model="tiny-test", prompt="Hello world", max_tokens=6,
                                            temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_chat_with_document_streaming_and_not(client, doc):
    msgs = [{"role": "user", "content": "How many ships were logged?"}]
    full = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=6, temperature=0,
                                          extra_body={"document": doc["id"]})
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"document": doc["id"]})
    parts, usage, reason = [], None, None
    for c in stream:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            parts.append(ch.delta.content or "")
            reason = ch.finish_reason or reason
    assert "".join(parts) == full.choices[0].message.content
    assert reason == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_seeded_sampling_reproducible(client, doc):
    kw = dict(model="tiny-test", prompt="Whalers", max_tokens=8, temperature=1.0, top_p=0.95, seed=7,
              extra_body={"document": doc["id"], "top_k": 40})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_raw_sse_format(server, doc):
    body = {"prompt": "Logbook", "max_tokens": 3, "temperature": 0, "stream": True, "document": doc["id"]}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e[6:])


def test_health_metrics_status(server, client, doc):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    client.completions.create(model="tiny-test", prompt="x", max_tokens=2, extra_body={"document": doc["id"]})
    m = httpx.get(server.url + "/metrics").text
    for name in ("polykv_requests_total", "polykv_completion_tokens_total", "polykv_live_agents",
                 'polykv_kv_bytes{kind="shared"}', 'polykv_kv_bytes{kind="naive"}', "polykv_step_seconds_bucket"):
        assert name in m, name
    s = httpx.get(server.url + "/v1/status").json()
    assert s["memory"]["kv_bytes_shared"] > 0
    assert any(d["id"] == doc["id"] for d in s["documents"])
    html = httpx.get(server.url + "/").text
    assert "/v1/status" in html and "<script>" in html
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-test"]


def test_disconnect_cancels_agent(server, doc):
    import time

    body = {"prompt": "Endless", "max_tokens": 700, "temperature": 0, "stream": True, "document": doc["id"],
            "ignore_eos": True}
    engine = server.config.app.state.polykv.engine
    before = engine.tokens_generated
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        next(it)
        assert httpx.get(server.url + "/v1/status").json()["live_agents"] == 1
    # client closed the connection: the agent must go away at a following step
    deadline = time.time() + 20
    while time.time() < deadline:
        if httpx.get(server.url + "/v1/status").json()["live_agents"] == 0:
            break
        time.sleep(0.1)
    assert httpx.get(server.url + "/v1/status").json()["live_agents"] == 0
    assert engine.tokens_generated - before < 700  # stopped early, not run to max_tokens


def test_concurrent_requests_all_answered(client, doc):
    out = {}

    def go(i):
        r = client.completions.create(model="tiny-test", prompt=f"Ship {i}", max_tokens=4, temperature=0.7,
                                      seed=i, extra_body={"document": doc["id"]} if i % 2 else None)
        out[i] = r.usage.completion_tokens

    ts = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert sorted(out) == list(range(8))


def test_disconnect_non_streaming_cancels_agent(server, doc):
    import time

    body = {"prompt": "Endless", "max_tokens": 700, "temperature": 0, "document": doc["id"], "ignore_eos": True}
    engine = server.config.app.state.polykv.engine
    before = engine.tokens_generated
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    deadline = time.time() + 20
    while time.time() < deadline and httpx.get(server.url + "/v1/status").json()["live_agents"]:
        time.sleep(0.1)
    assert httpx.get(server.url + "/v1/status").json()["live_agents"] == 0
    assert engine.tokens_generated - before < 700  # stopped early, not run to max_tokens


def test_usage_counts_the_document_as_cached_prompt_tokens(server, doc):
    body = {"prompt": "Ships:", "max_tokens": 3, "temperature": 0}
    plain = httpx.post(server.url + "/v1/completions", json=body).json()["usage"]
    over = httpx.post(server.url + "/v1/completions", json=dict(body, document=doc["id"])).json()["usage"]
    own = plain["prompt_tokens"]
    assert plain["prompt_tokens_details"] == {"cached_tokens": 0}
    assert over["prompt_tokens_details"] == {"cached_tokens": doc["tokens"]}
    assert over["prompt_tokens"] >= doc["tokens"] + 1
    assert over["total_tokens"] == over["prompt_tokens"] + over["completion_tokens"]
    lines = [ln for ln in httpx.post(server.url + "/v1/completions", json=dict(
        body, document=doc["id"], stream=True, stream_options={"include_usage": True})).text.splitlines()
        if ln.startswith("data: {")]
    assert json.loads(lines[-1][6:])["usage"] == over
    assert own > 0

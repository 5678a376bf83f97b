"""Real SmolLM2 over HTTP: concurrent agents on one shared document keep their private facts apart."""

import threading

import httpx
import pytest

from polykv.server import ServerThread, create_app

from ..engine._models import make_pool, real_model

pytestmark = pytest.mark.model

MEMO = ("Internal memo of the Harbor Street library. The reading room opens at nine. Members may borrow "
        "up to six books for three weeks. The rare-books cabinet is locked; its key is kept by the head "
        "librarian. Lost cards are replaced at the front desk for a small fee.")


@pytest.fixture(scope="module")
def live():
    model, tok = real_model()
    app = create_app(make_pool(model, tok), model_name="smollm2-135m")
    with ServerThread(app) as srv:
        doc = httpx.post(srv.url + "/v1/documents", json={"text": MEMO, "name": "memo"}, timeout=120).json()
        yield srv, doc["id"]


def _ask(url, doc, code, out, key):
    body = {"model": "smollm2-135m", "document": doc, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": f"Note: the visitor's locker number is {code}.\n"
                                                  "Question: What is the visitor's locker number?"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    out[key] = r


def test_private_facts_stay_private_under_concurrency(live):
    srv, doc = live
    facts = {"a": "4817", "b": "9263"}
    out = {}
    ts = [threading.Thread(target=_ask, args=(srv.url, doc, code, out, key)) for key, code in facts.items()]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    answers = {}
    for key, r in out.items():
        assert r.status_code == 200, r.text
        answers[key] = r.json()["choices"][0]["message"]["content"]
    assert facts["a"] in answers["a"] and facts["b"] not in answers["a"], answers
    assert facts["b"] in answers["b"] and facts["a"] not in answers["b"], answers
    # alone, each request answers the same (greedy): its neighbour did not change it
    solo = {}
    _ask(srv.url, doc, facts["a"], solo, "a")
    assert solo["a"].json()["choices"][0]["message"]["content"] == answers["a"]


def test_openai_client_real_model(live):
    import openai

    srv, doc = live
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
    r = client.chat.completions.create(model="smollm2-135m", max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "When does the reading room open?"}],
                                       extra_body={"document": doc})
    assert "nine" in r.choices[0].message.content.lower() or "9" in r.choices[0].message.content

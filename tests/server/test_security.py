"""--api-key: Bearer auth on every route but /health (and the static page / API description); a
warning when serving beyond loopback without a key; the CLI wires --api-key and POLYKV_API_KEY."""

import logging

import httpx
import openai
import pytest

from polykv.server import ServerThread, create_app
from polykv.server.runner import check_bind

from ..engine._models import make_pool

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def locked(tiny):
    model, tok = tiny
    app = create_app(make_pool(model, tok), model_name="tiny-test", api_key=KEY)
    with ServerThread(app) as srv:
        yield srv


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", "/v1/documents"), ("GET", "/v1/status"),
                                         ("GET", "/metrics"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("DELETE", "/v1/documents/x"),
                                         ("GET", "/v1/nothing")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY[:-1]}", f"Bearer {KEY}0"])
def test_routes_need_the_key(locked, method, path, auth):
    headers = {"Authorization": auth} if auth else {}
    r = httpx.request(method, locked.url + path, headers=headers, json={"prompt": "x"} if method == "POST" else None)
    assert r.status_code == 401, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_open_paths_and_the_right_key(locked):
    for path in ("/health", "/", "/openapi.json"):
        assert httpx.get(locked.url + path).status_code == 200, path
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(locked.url + "/v1/status", headers=auth).status_code == 200
    client = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.completions.create(model="tiny-test", prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=locked.url + "/v1", api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize("host,key,warns", [
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.5", None, True), ("example.org", None, True),
    ("0.0.0.0", KEY, False), ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False),
])
def test_bind_warning(caplog, host, key, warns):
    with caplog.at_level(logging.WARNING, logger="polykv.server"):
        assert check_bind(host, key) is warns
    assert any("without an API key" in r.getMessage() for r in caplog.records) is warns


def test_cli_serve_passes_the_key(monkeypatch):
    from typer.testing import CliRunner

    import polykv.server
    from polykv.cli import app

    seen = []
    monkeypatch.setattr(polykv.server, "serve", lambda **kw: seen.append(kw))
    monkeypatch.delenv("POLYKV_API_KEY", raising=False)
    runner = CliRunner()
    assert runner.invoke(app, ["serve", "--api-key", "k1"]).exit_code == 0
    assert runner.invoke(app, ["serve"], env={"POLYKV_API_KEY": "k2"}).exit_code == 0
    assert runner.invoke(app, ["serve"]).exit_code == 0
    assert [kw["api_key"] for kw in seen] == ["k1", "k2", None]


def test_serve_reads_env_and_warns(monkeypatch, caplog):
    """serve(): POLYKV_API_KEY when no key is given; the bind check runs before the model loads."""
    import polykv.server.runner as runner

    made = []
    monkeypatch.setattr(runner, "_make_app", lambda **kw: made.append(kw) or object())
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    monkeypatch.setenv("POLYKV_API_KEY", "from-env")
    with caplog.at_level(logging.WARNING, logger="polykv.server"):
        runner.serve(host="0.0.0.0")
    assert made[-1]["api_key"] == "from-env" and not caplog.records
    monkeypatch.delenv("POLYKV_API_KEY")
    with caplog.at_level(logging.WARNING, logger="polykv.server"):
        runner.serve(host="0.0.0.0")
    assert made[-1]["api_key"] is None and any("without an API key" in r.getMessage() for r in caplog.records)

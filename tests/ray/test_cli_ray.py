"""CLI smoke tests of the Ray flags: `polykv serve --ray ...` reaches `serve_ray` with every flag,
`polykv bench serve --ray` runs for real (one config, a tiny load, its own local Ray instance)."""

from __future__ import annotations

import json

import pytest

from ..test_cli_smoke import run_cli

pytestmark = pytest.mark.xdist_group("ray")


def test_serve_ray_flags_reach_serve_ray(monkeypatch):
    import polykv.ray.app

    seen = []
    monkeypatch.setattr(polykv.ray.app, "serve_ray", lambda **kw: seen.append(kw))
    pytest.importorskip("ray")
    run_cli(["serve", "--ray", "--replicas", "3", "--ray-address", "auto", "--cpus-per-replica", "0.5",
             "--torch-threads", "1", "--port", "8123", "--host", "127.0.0.1", "--store", "/tmp/s", "--k", "q4_0",
             "--gpu-budget", "1000000", "--api-key", "sekret"])
    assert len(seen) == 1
    kw = seen[0]
    assert (kw["replicas"], kw["address"], kw["cpus_per_replica"], kw["torch_threads"], kw["port"], kw["host"]) == \
        (3, "auto", 0.5, 1, 8123, "127.0.0.1")
    assert (kw["store"], kw["k"], kw["budget_bytes"], kw["api_key"]) == ("/tmp/s", "q4_0", 1000000, "sekret")


def test_plain_serve_does_not_import_ray():
    """`import polykv` and plain `polykv serve` (serve() stubbed) leave ray unimported."""
    import subprocess
    import sys

    code = ("import sys, polykv, polykv.server as s\n"
            "assert 'ray' not in sys.modules\n"
            "s.serve = lambda **kw: print('served', kw['port'])\n"
            "from polykv.cli import app\n"
            "try:\n    app(['serve', '--port', '8124'])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'ray' not in sys.modules, 'plain serve imported ray'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "served 8124" in out.stdout, out.stderr[-2000:]


def test_bench_serve_ray_refuses_mixed_load():
    res = run_cli(["bench", "serve", "--ray", "--malformed", "0.1"], ok=False)
    assert res.exit_code != 0 and "--ray runs good requests only" in res.output


@pytest.mark.slow
@pytest.mark.model
def test_bench_serve_ray_small_run():
    pytest.importorskip("ray")
    res = run_cli(["bench", "serve", "--ray", "--configs", "1x1", "--clients", "2", "--requests", "1",
                   "--max-tokens", "2", "--json"])
    out = json.loads([ln for ln in res.stdout.splitlines() if ln.strip()][-1])
    (row,) = out["rows"]
    assert (row["replicas"], row["torch_threads"], row["completed"], row["lost"], row["errors"]) == (1, 1, 2, 0, 0)
    assert 2 <= row["completion_tokens"] <= 4 and row["tok_per_s"] > 0
    (docs,) = row["placement"].values()
    assert len(docs) == 2 and row["prefills"] == 2 and row["loads"] == 0
    assert out["ratio"] is None and out["lost"] == 0


def test_bench_serve_ray_stops_its_ray_when_serve_fails(monkeypatch):
    """A failure inside the run (here Serve's start; under load an actor dying) still shuts down the
    Ray instance the bench started: a leaked one made every later `ray.init` in the session fail."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from polykv.bench.serve import bench_serve_ray

    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")

    def dead(**kw):
        raise RuntimeError("the Serve controller died")

    monkeypatch.setattr(serve, "start", dead)
    with pytest.raises(RuntimeError, match="controller died"):
        bench_serve_ray(configs="1x1", n_clients=1, requests_per_client=1, max_tokens=1)
    assert not ray.is_initialized()


def test_start_serve_retries_a_proxy_that_died_before_it_ran(monkeypatch):
    """On a loaded machine Serve's controller can kill a slow-starting HTTP proxy, and serve.start
    raises ActorDiedError: start_serve shuts Serve down and starts it again, up to `attempts` times."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from polykv.ray import start_serve

    calls = []

    def start(http_options):
        calls.append("start")
        if calls.count("start") < 3:
            raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("shutdown"))
    said = []
    start_serve({"port": 1}, note=said.append)
    assert calls == ["start", "shutdown", "start", "shutdown", "start"] and len(said) == 2
    calls.clear()
    with pytest.raises(ray.exceptions.ActorDiedError):
        start_serve({"port": 1}, attempts=2, note=said.append)
    assert calls == ["start", "shutdown", "start"]

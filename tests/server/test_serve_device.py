"""`polykv serve --device --dtype`: the model (and so the pool and the engine) goes where a GPU is,
in bfloat16 there, unless told otherwise; an unknown dtype is refused before anything loads."""

from __future__ import annotations

import pytest
import torch


def test_cli_serve_passes_device_and_dtype(monkeypatch):
    from typer.testing import CliRunner

    import polykv.server
    from polykv.cli import app

    seen = []
    monkeypatch.setattr(polykv.server, "serve", lambda **kw: seen.append(kw))
    runner = CliRunner()
    assert runner.invoke(app, ["serve"]).exit_code == 0
    assert runner.invoke(app, ["serve", "--device", "cuda:1", "--dtype", "float16"]).exit_code == 0
    assert [(kw["device"], kw["dtype"]) for kw in seen] == [("auto", "auto"), ("cuda:1", "float16")]
    bad = runner.invoke(app, ["serve", "--dtype", "int3"])
    assert bad.exit_code == 2 and "int3" in bad.output and len(seen) == 2


@pytest.mark.parametrize("cuda,device,dtype,want", [
    (True, None, "auto", ("cuda", torch.bfloat16)),
    (False, None, "auto", ("cpu", torch.float32)),
    (True, "cpu", "auto", ("cpu", torch.float32)),
    (True, "auto", "float32", ("cuda", torch.float32)),
])
def test_the_app_loads_the_model_where_asked(monkeypatch, cuda, device, dtype, want):
    import polykv.hf.loading as loading
    import polykv.server.app as app_mod
    import polykv.server.runner as runner

    loads = []

    class Model(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def load(name=None, *, device=None, dtype=torch.float32):
        loads.append((device, dtype))
        return Model(dtype), object()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(loading, "load_model", load)
    monkeypatch.setattr(runner, "build_pool", lambda m, tok, **kw: "pool")
    monkeypatch.setattr(app_mod, "create_app", lambda pool, **kw: ("app", pool))
    assert runner._make_app(device=device, dtype=dtype) == ("app", "pool")
    assert loads == [want]


def test_serve_logs_where_the_model_is(monkeypatch, capfd):
    """`polykv serve`'s first line says which model on which device: polykv's logger prints beside
    uvicorn's (which configures only its own)."""
    import logging

    import uvicorn

    import polykv.hf.loading as loading
    import polykv.server.app as app_mod
    import polykv.server.runner as runner

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

    monkeypatch.setattr(loading, "load_model", lambda name=None, *, device=None, dtype=None: (Model(), object()))
    monkeypatch.setattr(runner, "build_pool", lambda m, tok, **kw: "pool")
    monkeypatch.setattr(app_mod, "create_app", lambda pool, **kw: "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    root = logging.getLogger("polykv")
    handlers, propagate, level = list(root.handlers), root.propagate, root.level
    try:
        root.handlers[:] = []
        runner.serve(device="cpu")
        err = capfd.readouterr().err
        assert "INFO:     polykv serve: " in err and " on cpu (float32)" in err, err
    finally:
        root.handlers[:], root.propagate = handlers, propagate
        root.setLevel(level)

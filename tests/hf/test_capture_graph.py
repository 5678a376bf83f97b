"""capture_graph's garbage handling, on the CPU with a fake CUDA graph API: a finished batch's
graphs waiting in a reference cycle must be destroyed before the capture begins, and the cyclic
collector must not run during it (destroying a CUDA graph mid-capture invalidates the capture)."""

import contextlib
import gc

import pytest
import torch

from polykv.hf import graphs


class _Stream:
    def wait_stream(self, other):
        pass


def test_capture_collects_cycles_first_and_holds_the_collector(monkeypatch):
    events = []

    class FinishedBatchGraph:  # stands for a dropped graph held only by a reference cycle
        def __del__(self):
            events.append("destroyed")

    class FakeGraphContext:
        def __init__(self, graph, pool=None, capture_error_mode="global"):
            pass

        def __enter__(self):
            events.append(("capture begins", gc.isenabled()))

        def __exit__(self, *exc):
            events.append(("capture ends", gc.isenabled()))
            return False

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", FakeGraphContext)

    g = FinishedBatchGraph()
    g.me = g  # a cycle: only the cyclic collector frees it
    del g
    calls = []
    was = gc.isenabled()
    gc.enable()
    try:
        out = graphs.capture_graph(lambda: calls.append(1), warmup=2)
        assert gc.isenabled()  # given back
    finally:
        if not was:
            gc.disable()
    assert out == "graph" and len(calls) == 3  # 2 warm-ups + the captured call
    assert events == ["destroyed", ("capture begins", False), ("capture ends", False)]


def _fake_graph_api(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_capture_step_compiles_norms_and_mlps_for_the_capture_only(monkeypatch):
    """capture_step: warm-ups and capture run inside compiled_pointwise (the compiled kernels are
    what the graph records), nothing compiled outside; POLYKV_COMPILE=0 (COMPILE False) skips it."""
    inside = []

    @contextlib.contextmanager
    def fake_compiled(model):
        inside.append(True)
        yield 1
        inside.append(False)

    _fake_graph_api(monkeypatch)
    monkeypatch.setattr(graphs, "compiled_pointwise", fake_compiled)
    monkeypatch.setattr(graphs, "COMPILE", True)
    seen = []
    assert graphs.capture_step(lambda: seen.append(list(inside)), model=None) == "graph"
    assert seen == [[True]] * 3 and inside == [True, False]
    monkeypatch.setattr(graphs, "COMPILE", False)
    seen.clear()
    graphs.capture_step(lambda: seen.append(list(inside)), model=None)
    assert seen == [[True, False]] * 3  # no new compiled block


def test_capture_step_falls_back_to_eager_modules_when_compile_fails(monkeypatch):
    _fake_graph_api(monkeypatch)
    monkeypatch.setattr(graphs, "COMPILE", True)
    calls = []

    @contextlib.contextmanager
    def compiled(model):
        yield 1

    def step():
        calls.append(graphs.COMPILE)
        if graphs.COMPILE:  # the first warm-up compiles: say inductor has no toolchain here
            raise RuntimeError("inductor: no C compiler")

    monkeypatch.setattr(graphs, "compiled_pointwise", compiled)
    with pytest.warns(UserWarning, match="no C compiler"):
        assert graphs.capture_step(step, model=None) == "graph"
    assert calls == [True, False, False, False] and graphs.COMPILE is False


def test_compiled_pointwise_is_per_thread_and_one_block_at_a_time(monkeypatch):
    """Inside a block, this thread's norms / MLPs run the compiled forward; another thread running
    the same model meanwhile runs them eagerly (and compiles nothing); blocks of two threads do not
    overlap (dynamo is not thread-safe); on exit the modules are eager again."""
    import threading
    import time

    calls = []

    def fake_compile(fn):
        def compiled(*a, **k):
            calls.append(("compiled", threading.current_thread().name))
            return fn(*a, **k)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)

    class RMSNorm(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm()

        def forward(self, x):
            return self.norm(x)

    model, x = Toy(), torch.ones(2)
    inside, release, order = threading.Event(), threading.Event(), []

    def other():
        inside.wait()
        model(x)  # while the main thread's block is open: eager here
        release.set()
        with graphs.compiled_pointwise(model):  # waits for the main thread's block to close
            order.append("other in")
            model(x)

    t = threading.Thread(target=other, name="other")
    t.start()
    with graphs.compiled_pointwise(model) as n:
        assert n == 1
        model(x)
        inside.set()
        release.wait(5)
        time.sleep(0.2)  # room for the other thread to enter, were blocks not exclusive
        order.append("main out")
    t.join(5)
    assert calls == [("compiled", "MainThread"), ("compiled", "other")]
    assert order == ["main out", "other in"]
    assert model.norm._compiled_call_impl is None and torch.equal(model(x), x * 2)

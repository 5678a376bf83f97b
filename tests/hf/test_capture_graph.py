"""capture_graph's garbage handling, on the CPU with a fake CUDA graph API: a finished batch's
graphs waiting in a reference cycle must be destroyed before the capture begins, and the cyclic
collector must not run during it (destroying a CUDA graph mid-capture invalidates the capture)."""

import contextlib
import gc

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

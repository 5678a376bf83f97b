"""Fixtures shared by the speculative tests."""

from __future__ import annotations

import functools

import pytest

from polykv.pool import decode_graph
from tests.spec.helpers import DOC, spec_pool


@pytest.fixture(scope="module")
def setup():
    """(model, pool, doc id) over helpers.DOC, one per test module."""
    return spec_pool(DOC)


@pytest.fixture
def static_steps(monkeypatch):
    """Batches build DecodeGraphs steps (capture=False): what a CUDA graph replays, eagerly."""
    monkeypatch.setattr(decode_graph, "graphs_supported", lambda cache: True)
    monkeypatch.setattr(decode_graph, "DecodeGraphs", functools.partial(decode_graph.DecodeGraphs, capture=False))

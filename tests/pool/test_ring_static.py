"""The static decode step (decode_graph.py, what a CUDA graph would capture) with recent windows, run
eagerly on CPU: the windows' per-step work reads only device tensors (lengths, write rows), so the
static step must give the eager step's logits — decode, verify columns, bucket padding, removal,
storage growth, a parked batch. On CUDA such batches capture their steps: the GPU test at the end
compares captured with eager steps there."""

import functools
from types import SimpleNamespace

import pytest
import torch

from polykv.pool import SharedKVPool, decode_graph
from polykv.pool.decode_graph import DecodeGraphs, graphs_supported
from tests.pool.conftest import CharTok, tiny_gemma, tiny_llama
from tests.pool.test_decode_graph import _run as run_batch

DOC = list(range(3, 50))


def _run(model, tok, static: bool, recent: int, feeds, sufs):
    return run_batch(model, tok, "q8_0", "turbo3", static, feeds, sufs, recent=recent)[0]


@pytest.mark.parametrize("recent", [1, 3, 9])
def test_static_step_equals_eager_with_windows(tiny, recent):
    model, tok = tiny
    sufs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]  # 4 agents -> bucket 4; 3 after removal
    feeds = [[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31], [32, 33, 34, 35],
             [36, 37, 38, 39], [40, 41, 42, 43]]  # suffixes outgrow seq_capacity 4 and the windows
    a = _run(model, tok, False, recent, feeds, sufs)
    b = _run(model, tok, True, recent, feeds, sufs)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-5)


def test_static_columns_equal_eager_verify(tiny):
    """run_columns (the captured verify step) with windows: each real column's logits equal the
    eager forward of the same columns, and the step after a rollback too."""
    model, tok = tiny
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=3, prefill_chunk=16)
    doc = pool.add_document(DOC)
    sufs = [[5, 6], [7], [8, 9, 10]]
    cols = [[40, 41, 42], [43], [44, 45]]
    got = {}
    for static in (False, True):
        with pool.open_batch(doc, capacity=4, seq_capacity=16) as b:
            if static:
                b._graphs = DecodeGraphs(model, b.cache, pool._pad_id, capture=False)
            b.expect_drafts(2)
            aids = [b.add(s) for s in sufs]
            b.step()
            for a, c in zip(aids, cols):
                b.feed({a: c[0]}, {a: c[1:]} if len(c) > 1 else None)
            ids = b.step_verify()  # left-padded verify columns, rejected drafts rolled back
            b.feed({a: 50 + i for i, a in enumerate(aids)})
            got[static] = (ids, b.step(), b.cache.lens[:3].tolist())
            if static:
                assert any(w > 1 for _, w in b._graphs.widths())
    (ia, la, na), (ib, lb, nb) = got[False], got[True]
    assert ia == ib and na == nb
    for a in la:
        torch.testing.assert_close(lb[a], la[a], rtol=0, atol=1e-5)


@pytest.fixture
def static_graphs(monkeypatch):
    monkeypatch.setattr(decode_graph, "graphs_supported", lambda cache: True)
    monkeypatch.setattr(decode_graph, "DecodeGraphs", functools.partial(DecodeGraphs, capture=False))


SPEC = {"method": "prompt_lookup", "num_draft_tokens": 3, "adaptive": False, "min_ngram": 1}


@pytest.mark.parametrize("spec", [None, SPEC])
def test_generate_static_equals_eager(static_graphs, spec):
    """generate over the static steps (pipelined, or speculative verify steps) with windows, twice
    (the second call takes over the parked batch): the eager pool's answers."""
    model, tok = tiny_gemma(), CharTok()  # sliding and full layers (CUDA would capture neither yet)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
    eager = SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=4, prefill_chunk=32)
    doc = eager.add_document(DOC * 2)
    want = eager.generate(doc, prompts, max_new_tokens=20, speculative=spec, pipelined=False)
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", recent=4, prefill_chunk=32)
    pool.add_document(DOC * 2)
    for i in range(2):
        assert pool.generate(doc, prompts, max_new_tokens=20, speculative=spec) == want
        assert pool.last_generate["graph_captures"] > 0 or i == 1  # the static steps ran


def test_cuda_graphs_capture_windows(monkeypatch):
    """graphs_supported: a CUDA batch on the kernels captures with or without windows;
    POLYKV_CUDA_GRAPHS=0 and the forced reference do not."""
    from polykv.kernels import dispatch

    monkeypatch.setattr(dispatch, "use_triton", lambda *t: True)
    cache = SimpleNamespace(device=torch.device("cuda"), windows=[None], backend="auto",
                            store=[SimpleNamespace(k=SimpleNamespace(codes=None))], rings=object())
    assert graphs_supported(cache)
    cache.rings = None
    assert graphs_supported(cache)
    monkeypatch.setenv("POLYKV_CUDA_GRAPHS", "0")
    assert not graphs_supported(cache)
    monkeypatch.delenv("POLYKV_CUDA_GRAPHS")
    monkeypatch.setattr(dispatch, "use_triton", lambda *t: False)
    assert not graphs_supported(cache)


def _cuda_steps(model, graphs: bool, monkeypatch, recent: int = 4) -> tuple[list, int, list]:
    """Logits of 8 decode steps of 4 agents (one removed after two steps) on CUDA, eager or
    captured, with the captures made and a greedy `generate` (pipelined, then speculative)."""
    monkeypatch.setenv("POLYKV_CUDA_GRAPHS", "1" if graphs else "0")
    pool = SharedKVPool(model, CharTok(), k="q8_0", v="turbo3", recent=recent, prefill_chunk=32,
                        progress=False)
    doc = pool.add_document(DOC * 3)
    logits = []
    with pool.open_batch(doc, capacity=4, seq_capacity=4) as b:
        aids = [b.add(s) for s in ([5, 6, 7], [8, 9], [10, 11, 12, 13], [14])]
        b.step()
        for i in range(8):
            b.feed({a: 20 + 4 * i + j for j, a in enumerate(aids) if a in b.agents()})
            logits.append(torch.stack([lg.float().cpu() for _, lg in sorted(b.step().items())]))
            if i == 1:
                b.remove(aids[0])
        captures = b.graph_captures
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
    answers = [pool.generate(doc, prompts, max_new_tokens=16, speculative=spec)
               for spec in (None, SPEC)]
    return logits, captures, answers


@pytest.mark.gpu
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma])
def test_windows_captured_on_cuda(monkeypatch, make):
    """On the GPU, batches with recent windows (and Gemma's sliding layers) capture their steps, and
    the replays give the eager steps' logits: same kernels, same shapes but the bucket's padding
    (float32 model; the kernels' fp16 arithmetic bounds the difference) and the same greedy answers,
    plain and speculative."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = make(head_dim=64).cuda()  # the GPU kernels' smallest paged row tile needs >= 64
    want, none, want_answers = _cuda_steps(model, False, monkeypatch)
    got, captures, answers = _cuda_steps(model, True, monkeypatch)
    assert none == 0 and captures > 0
    for x, y in zip(want, got):
        torch.testing.assert_close(y, x, rtol=0, atol=2e-3)
    assert answers == want_answers

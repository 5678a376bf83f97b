"""Planned launches (kernels/launch.py, the plans of triton_decode) on the GPU: a repeated eager call
takes the planned path, and every call gives the bits of Triton's own launch path
(`launch.enabled = False`) — across new tensors of the same shapes, other lengths, left padding,
page tables, misaligned views and turbo keys with InnerQ scales."""

from __future__ import annotations

import pytest
import torch

from polykv.codecs import get_codec
from polykv.kernels import attention_decode, cascade_attention
from polykv.kernels import launch as L
from polykv.kernels import triton_decode as td

pytestmark = pytest.mark.gpu


def _rnd(g, *shape):
    return torch.randn(*shape, device="cuda", dtype=torch.float16, generator=g)


def _both(fn):
    """(planned-path result, Triton-path result) of the same call."""
    L.enabled = True
    try:
        got = [t.clone() for t in fn()]
        L.enabled = False
        ref = fn()
    finally:
        L.enabled = True
    return got, ref


@pytest.mark.parametrize("kname,vname", [("q8_0", "turbo3"), ("turbo4", "turbo3"), ("turbo3", "turbo2")])
def test_decode_plans_equal_tritons_launch(kname, vname):
    g = torch.Generator(device="cuda").manual_seed(1)
    kc, vc = get_codec(kname, 128), get_codec(vname, 128)
    innerq = (torch.rand(8, 128, device="cuda", generator=g) + 0.5) if kc.rotated else None
    B, S = 3, 1000
    kp, vp = kc.encode(_rnd(g, B, 8, S, 128)), vc.encode(_rnd(g, B, 8, S, 128))
    before = len(td._PLANS)
    for step in range(4):  # new q, lengths and left padding every call; same shapes
        q = _rnd(g, B, 32, 1, 128)
        lens = torch.randint(100, S, (B,), device="cuda", generator=g, dtype=torch.int32)
        start = torch.randint(0, 50, (B,), device="cuda", generator=g, dtype=torch.int32)
        for kw in ({}, {"kv_lens": lens}, {"kv_lens": lens, "kv_start": start}):
            got, ref = _both(lambda: attention_decode(q, kp, vp, kc, vc, k_innerq=innerq, **kw))
            for a, b in zip(got, ref):
                assert torch.equal(a, b), (step, kw)
    assert len(td._PLANS) > before  # the planned path ran


def test_decode_plan_keys_on_alignment_and_strides():
    """A misaligned view of q (another specialisation) and a strided one plan separately and still
    give Triton's bits."""
    g = torch.Generator(device="cuda").manual_seed(2)
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    kp, vp = kc.encode(_rnd(g, 1, 8, 777, 128)), vc.encode(_rnd(g, 1, 8, 777, 128))
    flat = _rnd(g, 32 * 128 + 8)
    for q in (flat[:32 * 128].view(1, 32, 1, 128), flat[8:].view(1, 32, 1, 128),
              _rnd(g, 1, 1, 32, 128).transpose(1, 2)):
        for _ in range(2):
            got, ref = _both(lambda: attention_decode(q, kp, vp, kc, vc))
            assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("N,paged,kname,n_q,D", [(8, True, "q8_0", 1, 128), (5, False, "q8_0", 1, 128),
                                                (32, False, "q8_0", 1, 128), (8, False, "turbo4", 1, 128),
                                                (8, False, "q8_0", 3, 128), (32, False, "q8_0", 3, 64)])
def test_cascade_plans_equal_tritons_launch(N, paged, kname, n_q, D):
    """The planned cascade call (one key: prefix pass, suffix pass, combine; on sm_90 the
    warp-specialised prefix pass reads the agents' rows in place) gives Triton's bits, and the
    reference's values within the kernels' tolerance. Several query columns (a verify step's
    strided q): out is stored token-major; head_dim 64: the tile kernel's prefix pass reads the
    agents' rows in place."""
    from polykv.kernels import cascade_attention_ref

    g = torch.Generator(device="cuda").manual_seed(3 + N)
    kc, vc = get_codec(kname, D), get_codec("turbo3", D)
    pk, pv = kc.encode(_rnd(g, 1, 8, 4096, D)), vc.encode(_rnd(g, 1, 8, 4096, D))
    P = 64
    rows = 4 * N * P if paged else 4 * P
    sk, sv = kc.encode(_rnd(g, 1 if paged else N, 8, rows, D)), vc.encode(_rnd(g, 1 if paged else N, 8, rows, D))
    before = len(td._CALLS)
    for _ in range(3):
        pages = torch.randperm(4 * N, device="cuda", generator=g).to(torch.int32).view(N, 4) if paged else None
        lens = torch.randint(0, 4 * P, (N,), device="cuda", generator=g, dtype=torch.int32)
        q = _rnd(g, N, n_q, 32, D).transpose(1, 2)
        got, ref = _both(lambda: cascade_attention(q, pk, pv, sk, sv, lens, kc, vc,
                                                   suffix_pages=pages, page_size=P if paged else 0))
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        assert ref[0].transpose(1, 2).is_contiguous()  # token-major where n_q > 1
    if not paged:
        want, _ = cascade_attention_ref(q, pk, pv, sk, sv, lens, kc, vc)
        err = (got[0].double() - want.double()).norm() / want.double().norm()
        assert err < 1e-2, err
    if kname == "q8_0" and D == 128 and torch.cuda.get_device_capability() == (9, 0):
        assert len(td._CALLS) > before  # the whole call was planned


@pytest.mark.parametrize("N,paged", [(32, False), (8, True)])
def test_captured_cascade_runs_its_suffix_pass_as_a_branch(monkeypatch, N, paged):
    """Captured in a CUDA graph, the planned cascade forks its suffix pass onto a side stream (a
    branch beside the prefix pass) and joins it before the combine: the replay gives the eager
    call's bits, and again with new query rows and lengths copied into the captured inputs."""
    from polykv.kernels import triton_cascade

    forks = []
    side = triton_cascade.side_stream
    monkeypatch.setattr(triton_cascade, "side_stream", lambda dev: forks.append(dev) or side(dev))
    g = torch.Generator(device="cuda").manual_seed(11 + N)
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    pk, pv = kc.encode(_rnd(g, 1, 8, 4096, 128)), vc.encode(_rnd(g, 1, 8, 4096, 128))
    P = 64
    rows = 4 * N * P if paged else 4 * P
    sk, sv = kc.encode(_rnd(g, 1 if paged else N, 8, rows, 128)), vc.encode(_rnd(g, 1 if paged else N, 8, rows, 128))
    pages = torch.randperm(4 * N, device="cuda", generator=g).to(torch.int32).view(N, 4) if paged else None
    lens = torch.randint(1, 4 * P, (N,), device="cuda", generator=g, dtype=torch.int32)
    q = _rnd(g, N, 32, 1, 128)

    def call():
        return cascade_attention(q, pk, pv, sk, sv, lens, kc, vc, suffix_pages=pages,
                                 page_size=P if paged else 0)

    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        call(), call()  # planned
    torch.cuda.current_stream().wait_stream(st)
    forks.clear()  # the plan asked for the stream when it was made; only the capture counts now
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    assert forks  # the captured call forked
    for _ in range(2):
        graph.replay()
        want, want_lse = call()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        q.copy_(_rnd(g, N, 32, 1, 128))
        lens.copy_(torch.randint(1, 4 * P, (N,), device="cuda", generator=g, dtype=torch.int32))

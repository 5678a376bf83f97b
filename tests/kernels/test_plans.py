"""Plans of repeated eager calls (triton_decode): on the CPU, with the launches faked, a repeated call
takes its plan and hands the planned launch the very tensors the full path hands Triton; anything
that changes a launch's static arguments (shapes, left padding, dtypes) plans anew. (The GPU test,
test_planned_launch_gpu.py, checks the outputs bit for bit.)"""

from __future__ import annotations

import pytest
import torch

from polykv.codecs import get_codec
from polykv.kernels import dispatch
from polykv.kernels import triton_decode as td


class _Planned:
    def __init__(self):
        self.calls = []

    def __call__(self, *tensors):
        self.calls.append(tensors)


@pytest.fixture
def launches(monkeypatch):
    """Faked launches: the full path's (kernel name, args) in order; plans are _Planned recorders."""
    full = []

    def launch(fn, grid, *args, plan=0, **consts):
        p = _Planned() if plan else None
        full.append((getattr(fn, "__name__", str(fn)), args, p))
        return p

    monkeypatch.setenv("POLYKV_TRITON_ON_CPU", "1")
    dispatch._k()  # the kernel modules imported (interpreter) before they are patched
    monkeypatch.setattr(td, "cached_launch", launch)
    monkeypatch.setattr(td, "_plannable", lambda dev: True)
    monkeypatch.setattr(td, "_PLANS", {})
    return full


def _name(entry):
    return entry[0].split(".")[-1]


def test_repeated_decode_takes_its_plans_with_the_same_tensors(launches):
    g = torch.Generator().manual_seed(0)
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    kp, vp = kc.encode(torch.randn(2, 2, 80, 128, generator=g)), vc.encode(torch.randn(2, 2, 80, 128, generator=g))
    q1, q2 = torch.randn(2, 8, 1, 128, generator=g), torch.randn(2, 8, 1, 128, generator=g)
    lens1, lens2 = torch.tensor([80, 50], dtype=torch.int32), torch.tensor([70, 9], dtype=torch.int32)
    out1, _ = dispatch.attention_decode(q1, kp, vp, kc, vc, kv_lens=lens1)
    assert [_name(e) for e in launches] == ["_phase_decode_kernel", "_combine_kernel"]
    (_, dargs, dplan), (_, cargs, cplan) = launches
    out2, lse2 = dispatch.attention_decode(q2, kp, vp, kc, vc, kv_lens=lens2)
    assert len(launches) == 2  # no full path: both launches planned
    (t,), (c,) = dplan.calls, cplan.calls
    assert len(t) == 13 and len(c) == 8
    assert t[0] is q2  # the query rows, this call's: a contiguous q's memory is its rows
    assert all(a is b for a, b in zip(t[1:7], dargs[1:7]))  # codes, factors, codebooks
    assert t[7] is lens2 and t[8] is lens2 and t[9] is dargs[9]  # lengths (no left padding), no pages
    assert t[10].shape == dargs[10].shape and t[11].shape == dargs[11].shape
    assert all(c[i] is t[10] and c[i + 1] is t[11] for i in (0, 2, 4))  # the combine reads them
    assert c[6] is out2 and c[7] is lse2 and out2.shape == out1.shape == (2, 8, 1, 128)
    # left padding, another capacity, int64 starts: new static arguments, the full path again
    start = torch.tensor([3, 0], dtype=torch.int32)
    dispatch.attention_decode(q2, kp, vp, kc, vc, kv_lens=lens2, kv_start=start)
    assert [_name(e) for e in launches[2:]] == ["_phase_decode_kernel"]  # the combine plan serves
    kp2, vp2 = kc.encode(torch.randn(2, 2, 96, 128, generator=g)), vc.encode(torch.randn(2, 2, 96, 128, generator=g))
    dispatch.attention_decode(q2, kp2, vp2, kc, vc, kv_lens=lens2)
    assert len(launches) == 4
    for _ in range(2):
        dispatch.attention_decode(q2, kp, vp, kc, vc, kv_lens=lens2, kv_start=start.long())
    assert len(launches) == 6  # not plannable: the kernel converts starts to int32 on each call


def test_turbo_key_query_preparation_is_planned(launches):
    g = torch.Generator().manual_seed(1)
    kc, vc = get_codec("turbo4", 128), get_codec("turbo3", 128)
    innerq = torch.rand(2, 128, generator=g) + 0.5
    kp, vp = kc.encode(torch.randn(1, 2, 64, 128, generator=g)), vc.encode(torch.randn(1, 2, 64, 128, generator=g))
    for i in range(2):
        q = torch.randn(1, 8, 1, 128, generator=g)
        dispatch.attention_decode(q, kp, vp, kc, vc, k_innerq=innerq)
        if i == 0:
            assert [_name(e) for e in launches] == ["_prep_q_kernel", "_phase_decode_kernel", "_combine_kernel"]
    assert len(launches) == 3
    (_, pargs, pplan), (_, dargs, dplan) = launches[:2]
    (p,), (d,) = pplan.calls, dplan.calls
    assert p[0] is q and torch.equal(p[1], pargs[1]) and p[2].shape == pargs[2].shape == (1, 2, 4, 128)
    assert d[0] is p[2]  # the decode pass reads the prepared rows


def test_a_repeated_call_runs_its_call_plan_alone(launches, monkeypatch):
    """The second identical-signature call is served by one CallPlan (no per-launch plans looked
    up, no launch path), handing its launches this call's tensors; another signature plans anew."""
    monkeypatch.setattr(td, "_CALLS", {})
    g = torch.Generator().manual_seed(2)
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    kp, vp = kc.encode(torch.randn(1, 2, 64, 128, generator=g)), vc.encode(torch.randn(1, 2, 64, 128, generator=g))
    q1, q2 = torch.randn(1, 8, 1, 128, generator=g), torch.randn(1, 8, 1, 128, generator=g)
    dispatch.attention_decode(q1, kp, vp, kc, vc)
    assert len(td._CALLS) == 1 and len(launches) == 2
    (_, dargs, dplan), (_, _, cplan) = launches

    def no_full_path(*a, **k):
        raise AssertionError("a planned call went through decode_prepared")

    monkeypatch.setattr(td, "decode_prepared", no_full_path)
    out2, lse2 = dispatch.attention_decode(q2, kp, vp, kc, vc)
    (d,), (c,) = dplan.calls, cplan.calls
    assert d[0] is q2 and d[1] is kp.codes and d[3] is vp.codes
    assert d[7] is dargs[7]  # the full-length kv_lens of (B, S)
    assert c[0] is d[10] and c[1] is d[11] and c[6] is out2 and c[7] is lse2
    assert out2.shape == (1, 8, 1, 128) and lse2.shape == (1, 8, 1) and out2.dtype == q2.dtype
    # fresh contiguous buffers of their own (made like a template: `td.like`)
    assert out2.is_contiguous() and lse2.is_contiguous() and lse2.dtype == torch.float32
    assert out2.untyped_storage().nbytes() == out2.numel() * out2.element_size()
    with pytest.raises(AssertionError, match="decode_prepared"):  # another window: not this plan
        dispatch.attention_decode(q2, kp, vp, kc, vc, window=16)


@pytest.fixture
def ws_launches(launches, monkeypatch):
    """`launches`, the call plans emptied, and the warp-specialised prefix pass faked in (on CPU)."""
    from polykv.kernels import gluon_prefix, triton_cascade

    monkeypatch.setattr(td, "_CALLS", {})
    monkeypatch.setattr(gluon_prefix, "cached_launch", td.cached_launch)
    monkeypatch.setattr(triton_cascade, "ws_ok", lambda qp, kc, vc: True)
    return launches


def _five_agents(g):
    """q8_0 / turbo3 codecs, a 128-row prefix (2 KV heads, head_dim 128) and 5 agents' 16-row
    suffixes with their lengths."""
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    pk, pv = kc.encode(torch.randn(1, 2, 128, 128, generator=g)), vc.encode(torch.randn(1, 2, 128, 128, generator=g))
    sk, sv = kc.encode(torch.randn(5, 2, 16, 128, generator=g)), vc.encode(torch.randn(5, 2, 16, 128, generator=g))
    return kc, vc, pk, pv, sk, sv, torch.tensor([16, 3, 0, 9, 16], dtype=torch.int32)


def test_a_repeated_cascade_runs_its_call_plan(ws_launches, monkeypatch):
    """The cascade's planned call (warp-specialised prefix pass faked in: it reads the agents'
    rows in place, no permuted copy), then the suffix pass and the combine, on this call's tensors."""
    from polykv.kernels import triton_cascade

    launches = ws_launches
    g = torch.Generator().manual_seed(4)
    kc, vc, pk, pv, sk, sv, sl = _five_agents(g)
    q1, q2 = torch.randn(5, 8, 1, 128, generator=g), torch.randn(5, 8, 1, 128, generator=g)
    dispatch.cascade_attention(q1, pk, pv, sk, sv, sl, kc, vc)
    assert [_name(e) for e in launches] == ["_ws_prefix_kernel", "_phase_decode_kernel", "_combine_kernel"]
    (_, wargs, wplan), (_, sargs, splan), (_, cargs, cplan) = launches
    assert wargs[0].shape == (5, 2, 4, 128)  # the agents' rows as they are: [N, Hkv, M, D]
    monkeypatch.setattr(triton_cascade, "cascade_prepared", lambda *a, **k: 1 / 0)
    sl2 = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)
    out, lse = dispatch.cascade_attention(q2, pk, pv, sk, sv, sl2, kc, vc)
    (w,), (sp,), (c,) = wplan.calls, splan.calls, cplan.calls
    # q contiguous: its memory is the rows [5, 2, 4, 128] the full path read (a view): q itself
    assert torch.equal(wargs[0], q1.reshape(5, 2, 4, 128)) and wargs[0].data_ptr() == q1.data_ptr()
    assert w[0] is q2 and w[1] is pk.codes and w[2] is pk.scales and w[3] is pv.codes
    assert w[5] is wargs[5]  # the prefix length
    assert sp[0] is w[0] and sp[1] is sk.codes and torch.equal(sp[7], sl2) and sp[9] is sargs[9]
    assert c[0] is w[6] and c[1] is w[7] and c[2] is sp[10] and c[3] is sp[11]
    assert c[6] is out and c[7] is lse and out.shape == (5, 8, 1, 128) and lse.shape == (5, 8, 1)
    assert out.dtype == q2.dtype and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous() and lse.untyped_storage().nbytes() == 4 * lse.numel()
    out3, _ = dispatch.cascade_attention(q2, pk, pv, sk, sv, sl2, kc, vc)
    assert out3.data_ptr() != out.data_ptr()  # a fresh output per call
    assert len(launches) == 3  # nothing took the launch path
    # the partials: addresses in one allocation, in order, each 64-byte aligned as the launches
    # were keyed, each with at least the room the full path's own buffer had
    parts = (w[6], w[7], sp[10], sp[11])
    assert all(type(p) is int and p % 64 == 0 for p in parts)
    room = [b - a for a, b in zip(parts, parts[1:])]
    assert all(r >= 4 * a.numel() for r, a in zip(room, (wargs[6], wargs[7], sargs[10])))


def test_a_cascade_plan_copies_a_strided_query(ws_launches):
    """A q that is not contiguous (a verify step's columns of a wider buffer) is copied into rows
    per call, as the full path does; the plan hands the launches the copy, not q."""
    g = torch.Generator().manual_seed(5)
    kc, vc, pk, pv, sk, sv, sl = _five_agents(g)
    wide = torch.randn(5, 8, 3, 128, generator=g)
    dispatch.cascade_attention(wide[:, :, 1:2], pk, pv, sk, sv, sl, kc, vc)
    (_, wargs, wplan), _, _ = ws_launches
    q2 = wide[:, :, 2:3]
    dispatch.cascade_attention(q2, pk, pv, sk, sv, sl, kc, vc)
    (w,) = wplan.calls
    assert w[0] is not q2 and w[0].is_contiguous() and torch.equal(w[0], q2.reshape(5, 2, 4, 128))


def test_a_cascade_tuned_with_nested_dicts_is_planned(ws_launches):
    """prefix_tune={"ws": {...}} (dicts in the tuning) keys a call plan like any other tuning."""
    launches = ws_launches
    g = torch.Generator().manual_seed(5)
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    pk, pv = kc.encode(torch.randn(1, 2, 64, 128, generator=g)), vc.encode(torch.randn(1, 2, 64, 128, generator=g))
    sk, sv = kc.encode(torch.randn(3, 2, 8, 128, generator=g)), vc.encode(torch.randn(3, 2, 8, 128, generator=g))
    sl = torch.tensor([8, 1, 5], dtype=torch.int32)
    q = torch.randn(3, 8, 1, 128, generator=g)
    tune = {"prefix_tune": {"ws": {"stages": 2}}}
    dispatch.cascade_attention(q, pk, pv, sk, sv, sl, kc, vc, **tune)
    assert len(launches) == 3 and len(td._CALLS) == 1
    dispatch.cascade_attention(q, pk, pv, sk, sv, sl, kc, vc, **tune)
    assert len(launches) == 3  # the second call: its plan
    dispatch.cascade_attention(q, pk, pv, sk, sv, sl, kc, vc, prefix_tune={"ws": {"stages": 3}})
    # other tuning, another call plan: the prefix pass launched anew (its split and combine
    # launches are unchanged: their own plans serve)
    assert [_name(e) for e in launches[3:]] == ["_ws_prefix_kernel"] and len(td._CALLS) == 2


def test_a_verify_width_cascade_stores_its_output_token_major(ws_launches, monkeypatch):
    """n_q > 1 (a verify step): the combine stores out token-major, eager and planned, so the
    model's [N, n_q, Hq * D] reshape of out.transpose(1, 2) is a view, not a copy per layer."""
    from polykv.kernels import triton_cascade

    launches = ws_launches
    g = torch.Generator().manual_seed(6)
    kc, vc, pk, pv, sk, sv, sl = _five_agents(g)

    def q():  # as a model's projection leaves it: [N, n_q, Hq, D] memory, viewed [N, Hq, n_q, D]
        return torch.randn(5, 2, 8, 128, generator=g).transpose(1, 2)

    out, lse = dispatch.cascade_attention(q(), pk, pv, sk, sv, sl, kc, vc)
    (_, _, _), (_, _, _), (_, cargs, cplan) = launches
    assert out.shape == (5, 8, 2, 128) and lse.shape == (5, 8, 2)
    assert out.transpose(1, 2).is_contiguous() and cargs[6].data_ptr() == out.data_ptr()
    monkeypatch.setattr(triton_cascade, "cascade_prepared", lambda *a, **k: 1 / 0)
    out2, lse2 = dispatch.cascade_attention(q(), pk, pv, sk, sv, sl, kc, vc)
    (c,) = cplan.calls
    assert c[6] is out2 and out2.shape == (5, 8, 2, 128) and out2.transpose(1, 2).is_contiguous()
    assert lse2.shape == (5, 8, 2) and lse2.is_contiguous()


def test_a_cascade_with_a_recent_segment_plans_its_third_pass(ws_launches, monkeypatch):
    """A cascade with a recent window's segment (`dispatch.cascade_attention(recent=)`): the
    segment's split pass is a third planned pass whose partials the one combine reads; a
    repeated call hands it this call's query rows, segment and starts."""
    from polykv.kernels import triton_cascade
    from polykv.kernels.reference import RecentSegment

    launches = ws_launches
    g = torch.Generator().manual_seed(5)
    kc, vc, rc = get_codec("q8_0", 128), get_codec("turbo3", 128), get_codec("q8_0", 128)
    pk, pv = kc.encode(torch.randn(1, 2, 128, 128, generator=g)), vc.encode(torch.randn(1, 2, 128, 128, generator=g))
    sk, sv = kc.encode(torch.randn(3, 2, 16, 128, generator=g)), vc.encode(torch.randn(3, 2, 16, 128, generator=g))
    sl = torch.tensor([16, 3, 0], dtype=torch.int32)

    def seg():
        return RecentSegment(rc.encode(torch.randn(3, 2, 8, 128, generator=g)),
                             rc.encode(torch.randn(3, 2, 8, 128, generator=g)), rc, 8,
                             torch.tensor([0, 4, 8], dtype=torch.int32))

    q1, q2, r1, r2 = torch.randn(3, 8, 1, 128, generator=g), torch.randn(3, 8, 1, 128, generator=g), seg(), seg()
    dispatch.cascade_attention(q1, pk, pv, sk, sv, sl, kc, vc, recent=r1)
    assert [_name(e) for e in launches] == ["_ws_prefix_kernel", "_phase_decode_kernel",
                                            "_phase_decode_kernel", "_combine_kernel"]
    (_, wargs, wplan), (_, sargs, splan), (_, rargs, rplan), (_, cargs, cplan) = launches
    assert rargs[1] is r1.k.codes and rargs[8] is r1.kv_start
    assert rargs[0] is sargs[0]  # q8_0 keys leave q plain: the segment reads the suffix's rows, no copy
    monkeypatch.setattr(triton_cascade, "cascade_prepared", lambda *a, **k: 1 / 0)
    out, lse = dispatch.cascade_attention(q2, pk, pv, sk, sv, sl, kc, vc, recent=r2)
    (w,), (sp,), (rp,), (c,) = wplan.calls, splan.calls, rplan.calls, cplan.calls
    assert rp[0] is q2 and rp[1] is r2.k.codes and rp[3] is r2.v.codes  # q's rows: q itself
    assert rp[0] is sp[0]
    assert torch.equal(rp[7], torch.full((3,), 8)) and rp[8] is r2.kv_start
    assert c[0] is w[6] and c[2] is sp[10] and c[4] is rp[10] and c[5] is rp[11]
    assert c[6] is out and c[7] is lse and len(launches) == 4
    with pytest.raises(ValueError, match="recent window R=8"):  # a sliding layer's R < its window
        dispatch.cascade_attention(q2, pk, pv, sk, sv, sl, kc, vc, recent=r2, window=8)

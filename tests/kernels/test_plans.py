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
    assert len(t) == 12 and len(c) == 6
    assert torch.equal(t[0], q2.reshape(2, 2, 4, 128))  # the query rows, this call's
    assert all(a is b for a, b in zip(t[1:7], dargs[1:7]))  # codes, factors, codebooks
    assert t[7] is lens2 and t[8] is lens2 and t[9] is dargs[9]  # lengths (no left padding), no pages
    assert t[10].shape == dargs[10].shape and t[11].shape == dargs[11].shape
    assert c[0] is t[10] and c[1] is t[11] and c[2] is t[10] and c[3] is t[11]  # the combine reads them
    assert c[4] is out2 and c[5] is lse2 and out2.shape == out1.shape == (2, 8, 1, 128)
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

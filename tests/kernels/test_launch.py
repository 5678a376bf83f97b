"""The launch cache (kernels/launch.py): its key splits arguments exactly where Triton's specialisation
does, and a cached launch passes the launcher what Triton's own launch passes."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from polykv.kernels import launch as L  # noqa: E402


def _triton_spec(a):
    return native_specialize_impl(BaseBackend, a, False, True, True)


EDGES = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
         -(2**31), -(2**31) - 16, 2**63 - 16, 2**63, 2**64 - 16]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(EDGES), st.integers(-(2**40), 2**40),
                          st.integers(0, 2**64 - 1)), min_size=2, max_size=2))
def test_int_keys_split_where_triton_does(pair):
    a, b = pair
    if L.arg_spec(a) == L.arg_spec(b):  # one cached kernel serves both: Triton must agree
        assert _triton_spec(a) == _triton_spec(b), (a, b)


def test_tensor_keys_follow_dtype_and_alignment():
    base = torch.zeros(64, dtype=torch.int8)
    views = [base[i:] for i in range(0, 40)] + [torch.zeros(8, dtype=torch.float16)]
    for x in views:
        for y in views:
            if L.arg_spec(x) == L.arg_spec(y):
                assert _triton_spec(x) == _triton_spec(y)
    assert L.arg_spec(base[16:]) == L.arg_spec(base) != L.arg_spec(base[1:])
    with pytest.raises(TypeError):
        L.arg_spec(__import__("numpy").int64(3))  # specialised by value: no key, Triton's path


def _kern(X, Y, n, scale, A: "tl.constexpr", B: "tl.constexpr" = 7, C: "tl.constexpr" = "x"):  # noqa: F821
    pass


class _FakeKernel:
    function, packed_metadata = "fn-handle", "meta"

    def __init__(self):
        self.launches = []

    def run(self, *a):
        self.launches.append(a)


@pytest.fixture
def fake(monkeypatch):
    """A real JITFunction whose Triton launch is faked: records slow-path launches and the
    compiled kernel's launcher calls."""
    fn = JITFunction(_kern)
    kernel, slow = _FakeKernel(), []

    def run(self, *args, grid, warmup, **kwargs):
        slow.append((grid, args, kwargs))
        return kernel

    class _Active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda dev: 1234)

    class _Driver:
        active = _Active()

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(sys.modules["triton.runtime.driver"], "driver", _Driver())
    monkeypatch.setattr(L, "enabled", True)
    L._CACHE.clear()
    yield fn, kernel, slow
    L._CACHE.clear()


def test_cached_launch_passes_what_triton_binds(fake):
    fn, kernel, slow = fake
    x, y = torch.zeros(32, dtype=torch.float16), torch.zeros(32, dtype=torch.int8)
    L.launch(fn, (4, 2), x, y, 32, 0.5, A=3, num_warps=2)
    assert len(slow) == 1 and kernel.launches == []
    L.launch(fn, (5,), x, y, 48, 0.25, A=3, num_warps=2)  # 48: divisible by 16 as 32 was
    assert len(slow) == 1
    assert kernel.launches == [(5, 1, 1, 1234, "fn-handle", "meta", None, None, None,
                                x, y, 48, 0.25, 3, 7, "x")]
    L.launch(fn, (5,), x, y, 48, 0.25, A=3, C="y", num_warps=2)  # another constexpr value
    L.launch(fn, (5,), x, y, 40, 0.25, A=3, num_warps=2)  # 40: not divisible by 16
    L.launch(fn, (5,), x, y, 1, 0.25, A=3, num_warps=2)  # 1: a constexpr for Triton
    L.launch(fn, (5,), x[1:], y, 48, 0.25, A=3, num_warps=2)  # misaligned pointer
    L.launch(fn, (5,), x.float(), y, 48, 0.25, A=3, num_warps=2)  # another dtype
    L.launch(fn, (5,), x, y, 48, 0.25, A=3, num_warps=4)  # another launch option
    assert len(slow) == 7 and len(kernel.launches) == 1


def test_hooks_and_switch_take_tritons_path(fake, monkeypatch):
    fn, kernel, slow = fake
    x = torch.zeros(32)
    for _ in range(2):
        L.launch(fn, (1,), x, x, 16, 1.0, A=1)
    assert (len(slow), len(kernel.launches)) == (1, 1)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    L.launch(fn, (1,), x, x, 16, 1.0, A=1)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(L, "enabled", False)
    L.launch(fn, (1,), x, x, 16, 1.0, A=1)
    assert (len(slow), len(kernel.launches)) == (3, 1)


class _Launcher:
    """Triton 3.6's CudaLauncher shape: __call__ allocates scratch, then calls `launch`."""

    launch_cooperative_grid, launch_pdl, profile_scratch_size = False, True, 0

    def __init__(self, scratch: int):
        self.global_scratch_size, self.calls, self.direct = scratch, [], []
        self.launch = lambda *a: self.direct.append(a)

    def __call__(self, *a):
        self.calls.append(a)


@pytest.mark.parametrize("scratch", [0, 256])
def test_scratch_free_kernels_take_the_compiled_launcher(fake, scratch):
    """Without scratch memory the compiled launcher is called directly (its flags, no scratch
    buffers, metadata, no hooks); a kernel that needs scratch keeps Triton's wrapper."""
    fn, kernel, slow = fake
    kernel.run = _Launcher(scratch)
    x = torch.zeros(32, dtype=torch.float16)
    L.launch(fn, (2,), x, x, 16, 1.0, A=1)
    planned = L.launch(fn, (2,), x, x, 16, 1.0, A=1, plan=1)
    planned(x[16:])
    if scratch:
        assert kernel.run.direct == []
        calls, head = kernel.run.calls, (2, 1, 1, 1234, "fn-handle", "meta", None, None, None)
    else:
        assert kernel.run.calls == []
        calls = kernel.run.direct
        head = (2, 1, 1, 1234, "fn-handle", False, True, None, None, "meta", None, None, None)
    n = len(head)
    assert len(calls) == 2 and all(c[:n] == head for c in calls)
    assert calls[0][n] is x and calls[1][n].data_ptr() == x[16:].data_ptr()  # the planned tensor
    # the kept tensor: itself on the first launch, its address on the planned one (no pointer
    # query per launch)
    assert calls[0][n + 1] is x and calls[1][n + 1] == x.data_ptr()
    assert all(c[n + 2:] == (16, 1.0, 1, 7, "x") for c in calls)

"""The agents' windows on Triton's kernels (interpreter, fresh process: POLYKV_TRITON_ON_CPU=1):
the window segment (`attention_decode` with causal, window R and kv_start), the cascade with
suffix lengths L - R over the paged suffix, and the LSE merge, against test_ring.py's oracle within
the kernels' fp16 tolerance — the GPU's code path, checked without a GPU."""

from tests.pool.conftest import run_interpreted

_SCRIPT = r"""
import json
import tests.pool.test_ring as t
from polykv.kernels import dispatch

t.TOL = 5e-3  # fp16 kernels vs the float32 oracle
t.PAGE = 64  # the kernels read one page per row tile
t.test_window_equals_oracle([t.FULL], 4)
t.test_window_equals_oracle([t.INNERQ, t.SLIDING], 3)
t.test_deep_cut_refills_from_the_pages()

# the kernels one decode forward launches: per layer one write (the ring step, the page write in
# it), and one combine (full and sliding layers: the window is a pass of the cascade)
from triton.runtime.interpreter import InterpretedFunction
cache, oracle = t.make([t.FULL, t.SLIDING], 4, seed=2)
cache.reserve(2)
t.forward(cache, oracle, [0, 1], [6, 2], 6, 0)
names, run = [], InterpretedFunction.run
InterpretedFunction.run = lambda fn, *a, **k: names.append(fn.__name__) or run(fn, *a, **k)
t.forward(cache, oracle, [0, 1], [1, 1], 1, 1)
InterpretedFunction.run = run
counts = {n: names.count(n) for n in set(names)}
print(json.dumps({"ok": True, "triton": dispatch.use_triton(__import__("torch").zeros(1)),
                  "launches": counts}))
"""


def test_windows_through_triton_kernels_interpreted():
    got = run_interpreted(_SCRIPT)
    launches = got.pop("launches")
    assert got == {"ok": True, "triton": True}
    # 2 layers: a ring step each (no separate quantize launch), one combine each (no merge)
    assert launches["_ring_step_kernel"] == 2 and launches["_combine_kernel"] == 2
    assert "_quantize_kernel" not in launches and "_quantize_pair_kernel" not in launches
    assert "_merge_kernel" not in launches

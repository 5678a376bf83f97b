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
print(json.dumps({"ok": True, "triton": dispatch.use_triton(__import__("torch").zeros(1))}))
"""


def test_windows_through_triton_kernels_interpreted():
    assert run_interpreted(_SCRIPT) == {"ok": True, "triton": True}

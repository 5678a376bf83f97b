"""launch_count's op counter: what it counts as a device kernel."""

import pytest
import torch

from polykv.bench.launch_count import _TorchOps
from polykv.kernels import triton_available


def test_a_reshape_that_copies_is_counted_one_that_views_is_not():
    """Inference mode hands reshape / flatten to the counter whole: a view where the layout allows
    one (not counted), a copy kernel where it does not (counted as '<op> (copy)')."""
    strided = torch.randn(4, 2, 6, 8).transpose(1, 2)  # [4, 6, 2, 8], rows 2 apart
    with torch.inference_mode(), _TorchOps([]) as ops:
        strided.reshape(4, 12, 8)  # merges two dims that are not adjacent in memory: a copy
        strided.reshape(4, 6, 2, 2, 4)  # splits the contiguous last dim: a view
        strided.contiguous().flatten(1, 2)  # contiguous copies; its flatten views
        strided.flatten(1, 2)
        strided.neg()
    assert ops.ops == {"reshape (copy)": 1, "contiguous": 1, "flatten (copy)": 1, "neg": 1}


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_a_verify_step_copies_the_query_rows_once_per_layer(monkeypatch):
    """The counted structure of a tiny Llama's verify step (2 drafts, R = 4) against its plain step:
    the verify columns' one remaining copy per layer is q's rows (the segment pass shares them, the
    cascade stores its output token-major: kernels_notes v22); the same Triton launches."""
    from polykv.bench.launch_count import count

    monkeypatch.setenv("POLYKV_TRITON_ON_CPU", "1")  # the kernels, through the interpreter
    monkeypatch.delenv("POLYKV_FORCE_REFERENCE", raising=False)
    res = count(recents=(4,), models=("llama",))
    plain, verify = res["llama_R4"], res["llama_R4_verify2"]
    assert verify["torch_by_op"].get("reshape (copy)") == verify["layers"] == 2
    assert "reshape (copy)" not in plain["torch_by_op"]
    assert verify["triton_by_kernel"] == plain["triton_by_kernel"]
    # a joining prompt's prefill (eager): its K/V rows are written through the quantize kernel
    joined = res["llama_R4_join20"]
    assert joined["triton_by_kernel"].get("_quantize_kernel", 0) >= 2 * joined["layers"]

"""launch_count's op counter: what it counts as a device kernel."""

import torch

from polykv.bench.launch_count import _TorchOps


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

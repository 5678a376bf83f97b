import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores, two xdist workers: one thread each keeps them from fighting.
torch.set_num_threads(1)

# Without a GPU, Triton kernels run through its interpreter (POLYKV_TRITON_ON_CPU=1 in the kernel
# tests). Triton fixes interpreter vs compiled when it is first imported, which other tests in the same
# worker may do first (transformers probes it), so the switch is set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run polykv/bench/gpu_suite.py on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

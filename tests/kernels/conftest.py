"""Fixtures of the kernel tests."""

import pytest
import torch

from polykv.kernels import use_triton


@pytest.fixture
def interpreter(monkeypatch):
    """Triton kernels on CPU tensors through Triton's interpreter (POLYKV_TRITON_ON_CPU=1), the
    reference not forced."""
    monkeypatch.setenv("POLYKV_TRITON_ON_CPU", "1")
    monkeypatch.delenv("POLYKV_FORCE_REFERENCE", raising=False)
    assert use_triton(torch.zeros(1))

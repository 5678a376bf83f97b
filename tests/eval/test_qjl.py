"""The QJL residual simulation (polykv.eval.qjl): the estimate is unbiased for <q, r> over projections,
its bits are the base codec's + m sign bits + one fp16 norm, "+qjl" types round-trip through the base
codec plus the estimate, and the precision module's round trip knows them only inside `qjl_types`."""

from __future__ import annotations

import pytest
import torch

from polykv.eval import qjl
from polykv.hf import precision


def test_estimate_is_unbiased_over_projections():
    g = torch.Generator().manual_seed(0)
    q, r = torch.randn(64, generator=g), 0.3 * torch.randn(64, generator=g)
    est = torch.stack([qjl.qjl_estimate(r[None], 64, seed=s)[0] @ q for s in range(3000)])
    # standard error of the mean ~ sqrt(pi/2 - 1) |q| |r| / sqrt(m) / sqrt(n)
    se = float(est.std()) / 3000 ** 0.5
    assert abs(float(est.mean()) - float(q @ r)) < 4 * se
    assert float(est.std()) > 0.1 * abs(float(q @ r))  # a real spread: one projection is one draw


def test_bits_and_names():
    assert qjl.parse("turbo2+qjl", 64) == ("turbo2", 64)
    assert qjl.parse("turbo2+qjl48", 64) == ("turbo2", 48)
    assert qjl.parse("turbo3", 64) == ("turbo3", 0)
    assert qjl.bits_per_value("turbo2+qjl", 64) == pytest.approx(2.25 + 1 + 0.25)
    assert qjl.bits_per_value("turbo2+qjl48", 64) == pytest.approx(3.25)  # turbo3's bits
    assert qjl.bits_per_value("turbo3", 64) == pytest.approx(3.25)


def test_roundtrip_and_context():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 16, 64, generator=g)
    scales = 0.5 + torch.rand(2, 64, generator=g)
    base = precision._roundtrip(keys, keys, "turbo2", "f16", scales)[0]
    torch.testing.assert_close(qjl.roundtrip_keys(keys, "turbo2", scales), base, rtol=0, atol=0)
    with_r = qjl.roundtrip_keys(keys, "turbo2+qjl", scales)
    # the residual estimate moves the keys toward the truth on average (MSE of turbo2 ~0.12/coord)
    assert float((with_r - keys).pow(2).mean()) != float((base - keys).pow(2).mean())
    assert float(((with_r - base) * (keys - base)).sum()) > 0
    with pytest.raises(Exception):
        precision._roundtrip(keys, keys, "turbo2+qjl", "f16", scales)
    with qjl.qjl_types():
        k, v = precision._roundtrip(keys, keys, "turbo2+qjl", "f16", scales)
        torch.testing.assert_close(k, with_r, rtol=0, atol=0)
        torch.testing.assert_close(v, keys.half().float(), rtol=0, atol=0)  # V stored as f16
    with pytest.raises(Exception):
        precision._roundtrip(keys, keys, "turbo2+qjl", "f16", scales)

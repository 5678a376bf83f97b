import torch

from polykv.codecs import InnerQTable, get_codec
from polykv.codecs.innerq import scales_from_rms


def skewed_keys(seed=0):
    g = torch.Generator().manual_seed(seed)
    chan = torch.exp(torch.randn(2, 128, generator=g) * 1.2)  # very unequal channel magnitudes
    return torch.randn(1, 2, 512, 128, generator=g) * chan[None, :, None, :]


def test_scale_rule_and_clamp():
    rms = torch.tensor([[1.0, 4.0, 0.01] + [1.0] * 12 + [1000.0]])
    s = scales_from_rms(rms)
    mean = rms.mean()
    assert torch.allclose(s, ((mean / rms) ** 0.5).clamp(0.5, 2.0))
    assert s.min() == 0.5 and s.max() == 2.0


def test_balanced_channels_skipped():
    assert scales_from_rms(torch.ones(3, 64) + 0.05 * torch.rand(3, 64)) is None
    table = InnerQTable.calibrate({0: torch.randn(1, 2, 4096, 64)})
    assert table.layer(0) is None


def test_qk_invariant_and_error_reduced(tmp_path):
    keys = skewed_keys()
    table = InnerQTable.calibrate({3: keys})
    assert table.layer(3).shape == (2, 128)
    q = torch.randn(1, 8, 4, 128)  # GQA: 4 q heads per kv head
    kq = table.scale_keys(3, keys)
    qs = table.scale_queries(3, q)
    ref = q @ keys.repeat_interleave(4, 1).transpose(-1, -2)
    got = qs @ kq.repeat_interleave(4, 1).transpose(-1, -2)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-3)
    codec = get_codec("turbo3", 128)
    plain = codec.decode(codec.encode(keys))
    scaled = table.unscale_keys(3, codec.decode(codec.encode(kq)))
    err = lambda y: float(((y - keys) ** 2).sum() / (keys ** 2).sum())
    assert err(scaled) < err(plain)
    path = tmp_path / "iq.safetensors"
    table.save(path)
    again = InnerQTable.load(path)
    assert set(again.scales) == {3} and torch.equal(again.layer(3), table.layer(3))


def test_load_refuses_foreign_file(tmp_path):
    from safetensors.torch import save_file
    import pytest

    save_file({"x": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not a polykv InnerQ"):
        InnerQTable.load(tmp_path / "x.safetensors")

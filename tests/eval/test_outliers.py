"""V outlier channels (polykv.eval.outliers) on tiny random Llamas with head_dim 64: the simulated cache
scores what an independent per-channel-subset round trip of the prefix's V scores (plain and rotated
attention domain, with a ring); channel selection; bits/value from the codecs' real bytes; the CLI
field."""

from __future__ import annotations

import pytest
import torch

from polykv.codecs import get_codec
from polykv.eval.outliers import (OutlierKVCache, VOutliers, outlier_bits, select_channels)
from polykv.hf.kv_cache import KVCache

PREFIX = 96
C = 32


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 120, (160,), generator=torch.Generator().manual_seed(3)).tolist()


def _spec(splits: str, model, by: str = "rms") -> VOutliers:
    """Channels from the first 64 tokens of a calibration sequence other than `ids`."""
    cal = torch.randint(3, 120, (64,), generator=torch.Generator().manual_seed(11)).tolist()
    return VOutliers.parse(f"c={C},by={by},{splits}").calibrated(model, None, ids=cal)


@torch.inference_mode()
def _logits(model, cache, ids):
    x = torch.tensor(ids)[None]
    model(input_ids=x[:, :PREFIX], past_key_values=cache, use_cache=True)
    return model(input_ids=x[:, PREFIX:], past_key_values=cache, use_cache=True).logits[0].float()


def _independent(v: torch.Tensor, chans: torch.Tensor, hi: str, lo: str) -> torch.Tensor:
    """V [1, H, S, 64] through `hi` on chans[h] and `lo` on the rest, head by head, with the codecs'
    encode / decode directly (not the module's helpers)."""
    out = v.clone()
    for h in range(v.shape[1]):
        sel = chans[h].tolist()
        rest = [j for j in range(v.shape[-1]) if j not in sel]
        for idx, t in ((sel, hi), (rest, lo)):
            c = get_codec(t, len(idx))
            out[0, h][:, idx] = c.decode(c.encode(v[0, h][:, idx].contiguous())).float()
    return out


@torch.inference_mode()
def _reference(model, ids, splits: dict, vo: VOutliers):
    """Prefill into a DynamicCache, replace each split layer's V by the independent round trip and K by
    its f16 rounding (what KVCache(k='f16') holds), score the rest: the chunk's own rows exact."""
    from transformers import DynamicCache

    x = torch.tensor(ids)[None]
    cache = DynamicCache()
    model(input_ids=x[:, :PREFIX], past_key_values=cache, use_cache=True)
    for i, lay in enumerate(cache.layers):
        lay.keys = lay.keys.half().float()
        lay.values = (_independent(lay.values, vo.channels[i], *splits[i]) if i in splits
                      else lay.values.half().float())
    return model(input_ids=x[:, PREFIX:], past_key_values=cache, use_cache=True).logits[0].float()


@pytest.mark.parametrize("base_v", ["f16", "turbo2"])
def test_simulated_cache_is_the_independent_split_round_trip(model, ids, base_v):
    """Layers 0 and 2 split (V stored as base_v: turbo2 makes attention run in the rotated domain, f16
    not), layer 1 kept at f16: the cache's logits are the reference's, and far from the unsplit
    cache's (the split is not a no-op: a mean logit difference of ~2 on this sharp model)."""
    vo = _spec(f"{base_v}=turbo3/turbo2", model)
    ov = {0: ("f16", base_v), 1: ("f16", "f16"), 2: ("f16", base_v)}
    if base_v == "f16":
        vo = VOutliers(c=C, splits=(("all", "turbo3", "turbo2"),), channels=vo.channels)
        ov = {i: ("f16", "f16") for i in range(3)}
        splits = {0: ("turbo3", "turbo2"), 1: ("turbo3", "turbo2"), 2: ("turbo3", "turbo2")}
    else:
        splits = {0: ("turbo3", "turbo2"), 2: ("turbo3", "turbo2")}
    got = _logits(model, OutlierKVCache(model, k="f16", v="f16", overrides=ov, outliers=vo), ids)
    want = _reference(model, ids, splits, vo)
    plain = _logits(model, KVCache(model, k="f16", v="f16", overrides=ov), ids)
    # exact up to float rounding (in the rotated domain: ~1e-4 mean, amplified by this sharp model)
    assert (got - want).abs().mean() < 1e-3 and (got - want).abs().max() < 1e-2
    assert (got - plain).abs().mean() > 0.1


def test_ring_rows_stay_q8_0(model, ids):
    """With a ring, the R rows before the chunk are the ring's (q8_0, all channels): the split cache
    with a ring equals the reference only without it, and lies closer to f16 with it than the split
    cache without a ring (the ring's rows are more precise than the split's)."""
    vo = _spec("all=turbo3/turbo2", model)
    f16 = _logits(model, KVCache(model, k="f16", v="f16"), ids)
    no_ring = _logits(model, OutlierKVCache(model, k="f16", v="f16", outliers=vo), ids)
    ring = _logits(model, OutlierKVCache(model, k="f16", v="f16", outliers=vo, recent=48), ids)
    assert (ring - no_ring).abs().max() > 1e-3
    assert (ring - f16).abs().mean() < (no_ring - f16).abs().mean()


def test_select_channels_finds_planted_outliers():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1, 2, 200, 64, generator=g)
    v[0, 0, :, 5] += 6.0  # large mean: rms and mean_abs see it, var does not
    v[0, 0, :, 40] *= 8.0  # large spread: all three see it
    v[0, 1, :, 63] *= 8.0
    for by in ("rms", "mean_abs", "var"):
        ch = select_channels(v, 4, by)
        assert ch.shape == (2, 4) and 40 in ch[0].tolist() and 63 in ch[1].tolist()
        assert (5 in ch[0].tolist()) == (by != "var"), by
    assert select_channels(v, 4, "first").tolist() == [[0, 1, 2, 3]] * 2


def test_bits_are_the_codecs_bytes(model, ids):
    """Split V bits = (bytes of a C-wide hi row + bytes of a (D - C)-wide lo row) x 8 / D from real
    encodes; unsplit layers keep their codec's; 'stored' is what the cache's tensors measure."""
    vo = _spec("turbo3=turbo3/turbo2,turbo4=q4_0/turbo3", model)
    ov = {0: ("q8_0", "turbo3"), 1: ("turbo3", "turbo2"), 2: ("turbo4", "turbo4")}
    cache = OutlierKVCache(model, k="f16", v="f16", overrides=ov, outliers=vo)
    _logits(model, cache, ids)
    row = torch.randn(5, 64)

    def b(t, w):  # bits/value of rows of width w, from the packed bytes of a real encode
        return get_codec(t, w).encode(row[:, :w].contiguous()).nbytes() * 8 / (5 * w)

    want_v = [(C * b("turbo3", C) + (64 - C) * b("turbo2", 64 - C)) / 64, b("turbo2", 64),
              (C * b("q4_0", C) + (64 - C) * b("turbo3", 64 - C)) / 64]
    want_k = [b("q8_0", 64), b("turbo3", 64), b("turbo4", 64)]
    got = outlier_bits(cache, vo)
    assert got["v_bits_per_layer"] == [round(x, 4) for x in want_v]
    assert got["v_bits_split"] == pytest.approx(sum(want_v) / 3)
    assert got["bits_per_value_split"] == pytest.approx((sum(want_k) + sum(want_v)) / 6)
    assert want_v[0] == pytest.approx(3.0) and want_v[2] == pytest.approx(4.0)  # 32 + 32 channels
    assert got["bits_per_value_stored"] == pytest.approx(cache.memory_report()["bits_per_value"], rel=1e-6)


def test_unsupported_subset_width_is_refused(model):
    from polykv.codecs import CodecError

    vo = VOutliers.parse("c=16,all=turbo3/turbo2").calibrated(
        model, None, ids=list(range(3, 40)))
    with pytest.raises(CodecError):  # turbo rows of 16 / 48 channels: no Walsh-Hadamard group
        OutlierKVCache(model, k="f16", v="f16", outliers=vo)
    with pytest.raises(ValueError):
        VOutliers.parse("c=32,by=rms")  # no split
    with pytest.raises(ValueError):
        VOutliers.parse("c=32,by=max,all=turbo3/turbo2")


@pytest.fixture(scope="module")
def tiny64_dir(tok, tmp_path_factory):
    """A tiny Llama over SmolLM2's tokenizer with head_dim 64 (a 32 + 32 split), as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id)
    d = tmp_path_factory.mktemp("tiny64")
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def test_cli_v_outliers_field(tiny64_dir):
    """`eval ppl --v-outliers SPEC`: the field v_outliers (channels, bits stored / split, ratio with the
    ring), no 'anchors'; the split changes the perplexity; combined with --head-types: refused."""
    from tests.eval.conftest import ppl_cli

    spec = "c=32,by=rms,tokens=256,turbo2=turbo3/turbo2"
    res, r = ppl_cli(tiny64_dir, "--v-outliers", spec, "--recent", "4")
    assert res.exit_code == 0, res.output
    f = r["v_outliers"]
    assert f["v_bits_split"] == pytest.approx(3.0) and f["v_bits_stored"] == pytest.approx(2.25)
    assert f["recent"] == 4 and len(f["channels"]) == 2 and len(f["channels"][0][0]) == 32
    assert f["ratio_expected_split"] == pytest.approx(16.0 / (f["bits_per_value_split"] + f["ring_bits"]))
    assert "anchors" not in r
    res2, r2 = ppl_cli(tiny64_dir, "--recent", "4")
    assert res2.exit_code == 0 and r2["ppl"] != r["ppl"] and r2["ppl_ref"] == r["ppl_ref"]
    res3, _ = ppl_cli(tiny64_dir, "--v-outliers", spec, "--head-types", "x.json@3")
    assert res3.exit_code != 0

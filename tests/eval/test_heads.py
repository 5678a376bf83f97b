"""Per-head types (polykv.eval.heads: a per-head table allocated, stored by KVCache head by head) and
the per-head measurement (measure_sensitivity(per_head=True)) on a tiny random Llama with 2 KV heads:
the cache scores what the measurement's substituted exact cache scores, head by head; uniform heads are
the plain per-layer cache; grouping, bits, ratio; loading by presets; the CLI field."""

from __future__ import annotations

import json

import pytest
import torch

from polykv.codecs import InnerQTable
from polykv.eval.heads import HeadTypes
from polykv.hf.kv_cache import KVCache, model_layout
from polykv.hf.precision import (K_TYPES, V_TYPES, layer_bits, layer_weights, load_precision, measure_sensitivity,
                                 ring_bits)

PREFIX = 96


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 120, (128,), generator=torch.Generator().manual_seed(3)).tolist()


def _innerq(model) -> InnerQTable:
    g = torch.Generator().manual_seed(1)
    c = model.config
    return InnerQTable({i: 0.5 + 1.5 * torch.rand(c.num_key_value_heads, c.head_dim, generator=g)
                        for i in range(c.num_hidden_layers)})


def _types(model, at: dict) -> HeadTypes:
    """f16 everywhere except {(layer, head): (k, v)}."""
    c = model.config
    t = tuple(tuple(at.get((i, h), ("f16", "f16")) for h in range(c.num_key_value_heads))
              for i in range(c.num_hidden_layers))
    return HeadTypes(t, 16.0)


@torch.inference_mode()
def _kl(model, cache, ids, ref) -> float:
    x = torch.tensor(ids)[None]
    model(input_ids=x[:, :PREFIX], past_key_values=cache, use_cache=True)
    lp = torch.log_softmax(model(input_ids=x[:, PREFIX:], past_key_values=cache, use_cache=True).logits[0].float(), -1)
    return float((ref.exp() * (ref - lp)).sum()) / lp.shape[0]


@torch.inference_mode()
def _ref(model, ids):
    from transformers import DynamicCache

    x = torch.tensor(ids)[None]
    cache = DynamicCache()
    model(input_ids=x[:, :PREFIX], past_key_values=cache, use_cache=True)
    return torch.log_softmax(model(input_ids=x[:, PREFIX:], past_key_values=cache, use_cache=True).logits[0].float(), -1)


@pytest.mark.parametrize("innerq", [False, True])
def test_stored_head_scores_what_the_measurement_substitutes(model, ids, innerq):
    """Each (layer, head, type) alone in a KVCache with per-head types gives the per-head table's error:
    the two paths (a round trip of exact rows into a DynamicCache; the head stored at its type) agree,
    so the head index and InnerQ are right in both. Head 1's error differs from head 0's (the slice is
    not the whole layer)."""
    iq = _innerq(model) if innerq else None
    table = measure_sensitivity(model, None, ids=ids, innerq=iq, prefix=PREFIX, per_head=True,
                                k_types=("turbo3",), v_types=("turbo2",))
    assert table.layers == 6 and table.meta["kv_heads"] == [2, 2, 2]
    ref = _ref(model, ids)
    for layer, head in ((0, 1), (2, 0), (1, 1)):
        u = 2 * layer + head
        for side, want in (("k", table.k_error[u]["turbo3"]), ("v", table.v_error[u]["turbo2"])):
            kv = ("turbo3", "f16") if side == "k" else ("f16", "turbo2")
            heads = _types(model, {(layer, head): kv})
            cache = KVCache(model, k="f16", v="f16", innerq=iq, overrides=heads.overrides())
            got = _kl(model, cache, ids, ref)
            assert want > 1e-6
            assert got == pytest.approx(want, rel=0.02, abs=1e-7), (layer, head, side)
    assert table.k_error[0]["turbo3"] != pytest.approx(table.k_error[1]["turbo3"], rel=0.02)


def test_uniform_heads_are_the_per_layer_cache(model, ids):
    """Every head of a layer at one type: no mixed layer, the logits of KVCache(overrides=per layer)."""
    per_layer = {0: ("turbo3", "turbo2"), 1: ("q8_0", "turbo3"), 2: ("turbo4", "turbo2")}
    ht = HeadTypes(tuple((kv, kv) for kv in per_layer.values()), 3.0)
    assert ht.as_dict()["layers_mixed"] == []
    cache = KVCache(model, k="f16", v="f16", overrides=ht.overrides(), recent=8)
    assert not any(lay.mixed for lay in cache.layers)
    ref = _ref(model, ids)
    a = _kl(model, cache, ids, ref)
    b = _kl(model, KVCache(model, k="f16", v="f16", overrides=per_layer, recent=8), ids, ref)
    assert a == b and a > 0


def test_mixed_heads_with_a_ring_differ_from_both_uniform_layers(model, ids):
    """One layer with a turbo3 and a q8_0 K head (ring of 8 rows kept): the score lies strictly between
    the all-turbo3 and the all-q8_0 layer (neither type stands for every head)."""
    ref = _ref(model, ids)
    base = {(0, 0): ("turbo3", "f16"), (0, 1): ("turbo3", "f16")}
    def cache(at):
        return KVCache(model, k="f16", v="f16", overrides=_types(model, at).overrides(), recent=8)

    lo = _kl(model, cache({k: ("q8_0", "f16") for k in base}), ids, ref)
    hi = _kl(model, cache(base), ids, ref)
    mix = _kl(model, cache({(0, 0): ("turbo3", "f16"), (0, 1): ("q8_0", "f16")}), ids, ref)
    assert lo < mix < hi


def test_from_table_groups_heads_and_counts_bits(model, tmp_path):
    """A per-head table allocated at a budget: rows grouped by layer, bits = the table's average, the
    ratio with a ring = 16 / (bits + ring bits); a per-layer table is refused. load_precision takes the
    per-head table for this model (kv_heads checked) and its policy's overrides are per head."""
    from polykv.hf.precision import PrecisionTable

    layout = model_layout(model)
    bits = [b for b in layer_bits(layout, set(K_TYPES) | set(V_TYPES)) for _ in range(2)]
    weight = [w / 2 for w in layer_weights(layout, 2048) for _ in range(2)]
    k_err = [{"turbo3": 1.0 + u, "turbo4": 0.5, "q8_0": 0.0} for u in range(6)]
    v_err = [{"turbo2": 1.0, "turbo3": 0.5, "turbo4": 0.4} for _ in range(6)]
    table = PrecisionTable(bits=bits, weight=weight, k_error=k_err, v_error=v_err, meta={"kv_heads": [2, 2, 2]})
    path = table.save(tmp_path / "t.precision.json")
    ht = HeadTypes.parse(f"{path}@3.0")
    pol = table.allocate(3.0)
    assert [kv for hs in ht.types for kv in hs] == list(pol.types)
    assert ht.bits == pol.bits_achieved <= 3.0
    assert any(len(set(hs)) > 1 for hs in ht.types)  # the budget splits at least one layer's heads
    assert ht.ratio_expected(layout, 8) == pytest.approx(16.0 / (pol.bits_achieved + ring_bits(layout, 8, 2048)))
    assert ht.as_dict()["bits_target"] == 3.0
    with pytest.raises(ValueError):
        HeadTypes.from_table(PrecisionTable(bits=bits[::2], weight=weight[::2], k_error=k_err[::2],
                                            v_error=v_err[::2]), 3.0)
    with pytest.raises(ValueError):
        HeadTypes.parse(str(path))
    loaded = load_precision(model, path)
    assert loaded.kv_heads == (2, 2, 2)
    ov = loaded.allocate(3.0).overrides()
    assert [list(ov[i]) if isinstance(ov[i], list) else [ov[i]] * 2 for i in range(3)] == [list(hs) for hs in ht.types]
    flat = loaded.per_layer()
    assert flat.layers == 3 and flat.kv_heads is None
    assert flat.k_error[1]["turbo3"] == pytest.approx(k_err[2]["turbo3"] + k_err[3]["turbo3"])
    assert flat.weight[1] == pytest.approx(weight[2] + weight[3])
    wrong = PrecisionTable(bits=bits, weight=weight, k_error=k_err, v_error=v_err, meta={"kv_heads": [3, 2, 1]})
    with pytest.raises(ValueError, match="kv_heads"):
        load_precision(model, wrong.save(tmp_path / "w.precision.json"))


def test_cli_head_types_field(tiny_dir, tiny, tmp_path):
    """`eval ppl --head-types TABLE@BITS`: the field head_types (bits, ratio with the ring), precision
    says the per-layer table was not used; --anchors with it is refused."""
    from polykv.hf.precision import PrecisionTable
    from tests.eval.conftest import ppl_cli

    layout = model_layout(tiny)
    n = len(layout)
    heads = [lay.num_kv_heads for lay in layout]
    bits = [b for b, h in zip(layer_bits(layout, set(K_TYPES) | set(V_TYPES)), heads) for _ in range(h)]
    weight = [w / h for w, h in zip(layer_weights(layout, 2048), heads) for _ in range(h)]
    k_err = [{"turbo3": 1.0, "turbo4": 0.5, "q8_0": 0.0} for _ in bits]
    v_err = [{"turbo2": 1.0, "turbo3": 0.5, "turbo4": 0.4} for _ in bits]
    path = PrecisionTable(bits=bits, weight=weight, k_error=k_err, v_error=v_err,
                          meta={"kv_heads": heads}).save(tmp_path / "h.precision.json")
    res, r = ppl_cli(tiny_dir, "--head-types", f"{path}@4.0", "--recent", "4")
    assert res.exit_code == 0, res.output
    assert r["head_types"]["bits_achieved"] <= 4.0 and r["head_types"]["recent"] == 4
    assert len(r["head_types"]["types"]) == n
    assert r["precision"]["source"] == "head_types" and "anchors" not in r
    res, _ = ppl_cli(tiny_dir, "--head-types", f"{path}@4.0", "--anchors", "recent=4")
    assert res.exit_code != 0

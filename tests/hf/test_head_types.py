"""KVCache with per-head types (`overrides={layer: [(k, v) per KV head]}`, issue K): the logits equal,
bit for bit, a DynamicCache whose stored rows went through each head's own codec (the per-head
FakeQuantCache); uniform heads are the per-layer cache; bytes are each head's codec's; decode runs
and DecodeGraph takes the eager step."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from polykv.codecs import InnerQTable, get_codec
from polykv.hf.graphs import DecodeGraph
from polykv.hf.kv_cache import KVCache

from .test_kv_cache import GREEDY, chunked_logits, tiny_llama

MIXED = {0: [("turbo3", "turbo2"), ("q8_0", "turbo3")], 2: [("q8_0", "q4_0"), ("turbo4", "turbo2")]}


class HeadFakeQuantCache(DynamicCache):
    """The reference: a DynamicCache (SDPA, true space) whose stored rows went through their head's
    codec once (InnerQ for turbo K: K*s encoded, decoded, /s); each chunk attends to the stored past
    plus its own exact rows, as KVCache's materialize path. types: {layer: [(k, v) per head]}, f16
    elsewhere."""

    def __init__(self, model, types, innerq=None):
        super().__init__(config=model.config)
        self.types, self.innerq, self.d = types, innerq, model.config.head_dim
        self.heads = model.config.num_key_value_heads

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        ks, vs = [], []
        for h, (kt, vt) in enumerate(self.types.get(layer_idx, [("f16", "f16")] * self.heads)):
            kc, vc = get_codec(kt, self.d), get_codec(vt, self.d)
            s = self.innerq.layer(layer_idx)[h] if self.innerq is not None and kc.rotated else None
            k = key_states[:, h:h + 1].float()
            k = k if s is None else k * s
            qk = kc.decode(kc.encode(k))
            ks.append(qk if s is None else qk / s)
            vs.append(vc.decode(vc.encode(value_states[:, h:h + 1].float())))
        k_all, v_all = super().update(torch.cat(ks, 1).to(key_states.dtype), torch.cat(vs, 1).to(value_states.dtype),
                                      layer_idx, *args, **kwargs)
        n = key_states.shape[2]
        return torch.cat([k_all[:, :, :-n], key_states], 2), torch.cat([v_all[:, :, :-n], value_states], 2)


def _innerq(model) -> InnerQTable:
    g = torch.Generator().manual_seed(1)
    c = model.config
    return InnerQTable({i: 0.5 + 1.5 * torch.rand(c.num_key_value_heads, c.head_dim, generator=g)
                        for i in range(c.num_hidden_layers)})


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("innerq", [False, True])
def test_logits_equal_per_head_reference(model, ids, innerq):
    iq = _innerq(model) if innerq else None
    ref = chunked_logits(model, HeadFakeQuantCache(model, MIXED, iq), ids, 8)
    cache = KVCache(model, k="f16", v="f16", overrides=MIXED, innerq=iq)
    got = chunked_logits(model, cache, ids, 8)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # the heads really are stored at their own types: one layer's heads swapped is another cache
    swapped = {**MIXED, 0: MIXED[0][::-1]}
    other = chunked_logits(model, KVCache(model, k="f16", v="f16", overrides=swapped, innerq=iq), ids, 8)
    assert float((other - ref).abs().mean()) > 20 * max(float((got - ref).abs().mean()), 1e-7)


def test_uniform_heads_are_the_per_layer_cache(model, ids):
    uniform = KVCache(model, k="f16", v="f16", overrides={1: [("q8_0", "turbo3")] * 2})
    per_layer = KVCache(model, k="f16", v="f16", overrides={1: ("q8_0", "turbo3")})
    assert not uniform.layers[1].mixed and uniform.layers[1].k_type == "q8_0"
    torch.testing.assert_close(chunked_logits(model, uniform, ids, 8), chunked_logits(model, per_layer, ids, 8),
                               rtol=0, atol=0)


def test_bytes_and_report(model, ids):
    cache = KVCache(model, k="f16", v="f16", overrides=MIXED)
    chunked_logits(model, cache, ids, 40)
    cache.compact()
    rep = cache.memory_report()
    row = rep["per_layer"][0]
    assert row["k"] == "turbo3,q8_0" and row["v"] == "turbo2,turbo3"
    assert row["head_types"] == [["turbo3", "turbo2"], ["q8_0", "turbo3"]]
    assert "head_types" not in rep["per_layer"][1]
    d, rows = model.config.head_dim, 40
    per_head = sum(get_codec(t, d).bits_per_value() for t in ("turbo3", "turbo2", "q8_0", "turbo3"))
    assert row["bytes"] == row["bytes_used"] == round(per_head * rows * d / 8)
    assert cache.nbytes() == sum(r["bytes"] for r in rep["per_layer"])
    assert repr(cache.layers[2]).startswith("PolyKVLayer(q8_0,turbo4/q4_0,turbo2")


def test_generate_and_decode_graph(model, ids):
    cache = KVCache(model, k="q8_0", v="turbo3", overrides=MIXED, recent=4)
    with torch.inference_mode():
        out = model.generate(input_ids=ids[:, :12], past_key_values=cache, max_new_tokens=6, **GREEDY)
    assert out.shape == (1, 18)
    assert cache.layers[0].mixed and cache.layers[0].ring is not None
    assert DecodeGraph(model, cache, 4).mode == "eager"


def test_wrong_head_count_refused(model):
    with pytest.raises(ValueError, match="one per KV head"):
        KVCache(model, k="f16", v="f16", overrides={0: [("q8_0", "turbo3")] * 3})
    with pytest.raises(ValueError, match="unknown|codec"):
        KVCache(model, k="f16", v="f16", overrides={0: [("q8_0", "turbo9"), ("q8_0", "turbo3")]})


def _head_table(model):
    """A per-head table for `model` whose errors make the max budget split heads: head 1 of every layer
    needs q8_0 K (large turbo K errors), head 0 does not."""
    from polykv.hf.kv_cache import model_layout
    from polykv.hf.precision import K_TYPES, V_TYPES, PrecisionTable, layer_bits, layer_weights

    layout = model_layout(model)
    heads = [lay.num_kv_heads for lay in layout]
    bits = [b for b, h in zip(layer_bits(layout, set(K_TYPES) | set(V_TYPES)), heads) for _ in range(h)]
    weight = [w / h for w, h in zip(layer_weights(layout, 2048), heads) for _ in range(h)]
    k_err = [{"turbo3": 50.0 * (u % 2) + 0.1, "turbo4": 40.0 * (u % 2) + 0.05, "q8_0": 0.0} for u in range(len(bits))]
    v_err = [{"turbo2": 1.0, "turbo3": 0.5, "turbo4": 0.4} for _ in bits]
    return PrecisionTable(bits=bits, weight=weight, k_error=k_err, v_error=v_err, meta={"kv_heads": heads})


def test_preset_takes_a_per_head_table_and_the_pool_its_layers(model, ids, tmp_path):
    """preset="max" with a per-head table: KVCache stores the allocation head by head (precision says
    per_head), and runs; SharedKVPool allocates the same table collapsed to layers, one pair each."""
    from polykv.hf.precision import PrecisionTable
    from polykv.pool import SharedKVPool
    from polykv.presets import PRESETS

    table = _head_table(model)
    path = table.save(tmp_path / "h.precision.json")
    cache = KVCache(model, preset="max", precision=str(path), recent=0)  # bits: the codecs' alone
    want = table.allocate(PRESETS["max"].bits)
    assert cache.precision["per_head"] is True and [tuple(t) for t in cache.precision["types"]] == list(want.types)
    assert any(lay.mixed for lay in cache.layers)
    for i, lay in enumerate(cache.layers):
        got = lay.head_types or ((lay.k_type, lay.v_type),) * 2
        assert list(got) == list(want.types[2 * i:2 * i + 2])
    chunked_logits(model, cache, ids, 8)
    assert cache.memory_report()["bits_per_value"] == pytest.approx(want.bits_achieved, rel=1e-9)

    class Tok:  # the pool's constructor reads nothing from its tokenizer
        pass

    pool = SharedKVPool(model, Tok(), preset="max", precision=str(path))
    flat = PrecisionTable.load(path).per_layer().allocate(PRESETS["max"].bits)
    assert pool.precision["per_head"] is False and pool.layer_types == list(flat.types)
    with pytest.raises(ValueError, match="one \\(k, v\\) pair per layer"):
        SharedKVPool(model, Tok(), k="q8_0", v="turbo3", overrides=MIXED)


@pytest.mark.parametrize("recent", [0, 4])
def test_fused_decode_takes_the_groups(model, ids, recent, monkeypatch):
    """A decode step of a cache with mixed layers on the fused path (forced on CPU: `dispatch` runs the
    reference kernels there) reads every layer through `_decode_stored`, with and without a ring, and
    stays near the materialize path (the fused path reads this step's own rows stored, the materialize
    path exact: a uniform q8_0/turbo3 cache differs by as much, ~1e-2 here; the layer-level test below
    checks the grouping exactly)."""
    import polykv.hf.kv_cache as kv_cache_mod

    iq, calls = _innerq(model), []
    real = kv_cache_mod._decode_stored
    def counted(layer, *a, **kw):
        calls.append(layer.mixed)
        return real(layer, *a, **kw)

    monkeypatch.setattr(kv_cache_mod, "_decode_stored", counted)

    def decode_logits(fused: bool):
        monkeypatch.setattr(kv_cache_mod, "_fused_available", lambda q: fused)
        cache = KVCache(model, k="q8_0", v="turbo3", overrides=MIXED, innerq=iq, recent=recent)
        with torch.inference_mode():
            model(input_ids=ids[:, :24], past_key_values=cache)
            return torch.cat([model(input_ids=ids[:, t:t + 1], past_key_values=cache).logits
                              for t in range(24, 32)], 1)

    ref = decode_logits(False)
    assert calls == []
    got = decode_logits(True)
    assert calls == [True, False, True] * 8
    assert float((got - ref).abs().max()) < 0.05


@pytest.mark.parametrize("causal", [False, True])
def test_decode_stored_equals_attention_over_each_heads_rows(causal):
    """`_decode_stored` on a mixed layer (3 groups over 4 KV heads, 2 q heads each, InnerQ on the turbo
    K heads): out and LSE of every q head equal softmax attention over its own KV head's decoded rows."""
    from polykv.hf.kv_cache import LayerLayout, PolyKVLayer, _decode_stored

    types = [("turbo3", "turbo2"), ("q8_0", "turbo3"), ("turbo3", "turbo2"), ("turbo4", "q8_0")]
    H, D, B, S, n_q, G = 4, 64, 2, 20, 2, 2
    g = torch.Generator().manual_seed(4)
    layer = PolyKVLayer(LayerLayout(0, H, D, None), "f16", "f16",
                        key_scales=0.5 + torch.rand(H, D, generator=g), head_types=types)
    k, v = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    layer.update(k, v)
    q = torch.randn(B, H * G, n_q, D, generator=g)
    out, lse = _decode_stored(layer, q, S, causal=causal, sm_scale=0.125)
    dk, dv = layer.store.dense()
    dk, dv = dk.repeat_interleave(G, 1), dv.repeat_interleave(G, 1)
    scores = (q @ dk.transpose(-1, -2)) * 0.125
    if causal:  # query j sits at row S - n_q + j
        pos = torch.arange(S)[None, :] > (S - n_q + torch.arange(n_q))[:, None]
        scores = scores.masked_fill(pos, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ dv, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=0, atol=1e-5)

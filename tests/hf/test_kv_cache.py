"""KVCache: a transformers Cache that holds only compressed K/V.

Fast tests use tiny random Llama / Gemma-3 models; tests marked `model` load SmolLM2 / Gemma-3-270M.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from polykv.codecs import CodecError, InnerQTable, get_codec
from polykv.hf.attention import active_cache
from polykv.hf.kv_cache import KVCache, UnsupportedModelError

GREEDY = dict(do_sample=False, pad_token_id=0)


def tiny_llama(head_dim=32, layers=3):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma(window=8):
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                           sliding_window=window, max_position_embeddings=1024,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(cfg).eval()


def dense_generate(model, **kw):
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        return model.generate(past_key_values=DynamicCache(config=model.config), **kw)


def kv_generate(model, k="f16", v="f16", **kw):
    cache = KVCache(model, k=k, v=v)
    with torch.inference_mode():
        return model.generate(past_key_values=cache, **kw), cache


def chunked_logits(model, cache, ids, step):
    if not isinstance(cache, KVCache):
        model.set_attn_implementation("sdpa")  # the reference never runs polykv's attention
    with torch.inference_mode():
        return torch.cat([model(input_ids=ids[:, s:s + step], past_key_values=cache).logits
                          for s in range(0, ids.shape[1], step)], 1)


class FakeQuantCache(DynamicCache):
    """The reference for KVCache: a plain transformers DynamicCache (SDPA attention, true space, no
    rotation) whose stored rows went through the codec once (encode -> decode; InnerQ: K*s encoded,
    decoded, /s). As in KVCache's materialize path, each chunk attends to the stored (compressed)
    past plus its own exact rows. Shares only the codec with KVCache, which tests/codecs checks
    against published values."""

    def __init__(self, model, k, v, innerq=None):
        super().__init__(config=model.config)
        d = model.config.head_dim
        self.kc, self.vc, self.innerq = get_codec(k, d), get_codec(v, d), innerq

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        s = self.innerq.layer(layer_idx) if self.innerq is not None and self.kc.rotated else None
        k = key_states.float() if s is None else key_states.float() * s[None, :, None, :]
        qk = self.kc.decode(self.kc.encode(k))
        qk = qk if s is None else qk / s[None, :, None, :]
        qv = self.vc.decode(self.vc.encode(value_states.float()))
        k_all, v_all = super().update(qk.to(key_states.dtype), qv.to(value_states.dtype), layer_idx,
                                      *args, **kwargs)
        n = key_states.shape[2]
        return torch.cat([k_all[:, :, :-n], key_states], 2), torch.cat([v_all[:, :, :-n], value_states], 2)


REF_ATOL = 1e-5  # rotated-domain attention vs the true-space reference, logits ~0.5 (measured <= 1e-6)


def assert_matches_reference(model, ids, k, v, step=8, innerq=None):
    """KVCache logits vs FakeQuantCache logits. True-space attention runs the very same operations:
    identical. Rotated-domain attention differs by float rounding (~1e-7), which now and then flips
    a quantization boundary of a later layer's key, and the flip shifts the positions after it
    (measured, tiny Gemma q8_0/turbo3: 1.8% of the logits beyond 1e-5, the worst 7e-5): at least 90%
    of the logits within REF_ATOL and none beyond 1e-3. A cache that mis-stores, mis-rotates or
    mis-scales rows is off nearly everywhere by >1e-3. Returns (ref, rotated)."""
    ref = chunked_logits(model, FakeQuantCache(model, k, v, innerq), ids, step)
    true = chunked_logits(model, KVCache(model, k, v, innerq=innerq, rotated_attention=False), ids, step)
    torch.testing.assert_close(true, ref, atol=0, rtol=0)
    got = chunked_logits(model, KVCache(model, k, v, innerq=innerq), ids, step)
    err = (got - ref).abs()
    assert float((err <= REF_ATOL).float().mean()) >= 0.9 and float(err.max()) <= 1e-3, \
        (float((err > REF_ATOL).float().mean()), float(err.max()))
    return ref, got


def assert_far(other, got, ref):
    """`got` is far closer to `ref` than to `other` (the caches compared really store different rows:
    a KVCache that kept dense rows, or ignored InnerQ, would sit on `other`)."""
    near = float((got - ref).abs().mean())
    far = float((got - other).abs().mean())
    assert far > 20 * max(near, 1e-7), (far, near)


def skew_keys(model, lo=0.3, hi=3.0):
    """Scale each layer's k_proj output channels (one factor per RoPE pair c, c + D/2) so key channel
    RMS spans ~10x: InnerQ calibration then scales every layer."""
    cfg = model.config
    f = torch.linspace(lo, hi, cfg.head_dim // 2).repeat(2).repeat(cfg.num_key_value_heads)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(f[:, None])
    return model


def reachable_tensors(obj) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from obj through attributes, lists, tuples and dicts."""
    seen, out, stack = set(), [], [("cache", obj)]
    while stack:
        path, o = stack.pop()
        if id(o) in seen or isinstance(o, (type, torch.nn.Module)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append((path, o))
        elif isinstance(o, dict):
            stack += [(f"{path}[{k!r}]", x) for k, x in o.items()]
        elif isinstance(o, (list, tuple, set)):
            stack += [(f"{path}[{i}]", x) for i, x in enumerate(o)]
        elif hasattr(o, "__dict__"):
            stack += [(f"{path}.{k}", x) for k, x in vars(o).items()]
    return out


# --- tiny models ---------------------------------------------------------------------------------

def test_f16_generate_matches_dynamic_cache_llama():
    m = tiny_llama()
    ids = torch.randint(1, 97, (1, 24))
    ref = dense_generate(m, input_ids=ids, max_new_tokens=16, **GREEDY)
    out, cache = kv_generate(m, input_ids=ids, max_new_tokens=16, **GREEDY)
    assert torch.equal(ref, out)
    assert m.config._attn_implementation == "polykv"
    assert cache.get_seq_length() == 24 + 16 - 1
    assert active_cache() is None  # the mark is consumed by each attention call


def test_batch_with_left_padding():
    m = tiny_llama()
    ids = torch.randint(1, 97, (2, 20))
    am = torch.ones(2, 20, dtype=torch.long)
    ids[1, :7] = 0
    am[1, :7] = 0
    ref = dense_generate(m, input_ids=ids, attention_mask=am, max_new_tokens=12, **GREEDY)
    out, cache = kv_generate(m, input_ids=ids, attention_mask=am, max_new_tokens=12, **GREEDY)
    assert torch.equal(ref, out)
    # each row equals its own unpadded single-sequence run
    single, _ = kv_generate(m, input_ids=ids[1:, 7:], max_new_tokens=12, **GREEDY)
    assert torch.equal(single[0, 13:], out[1, 20:])


def test_attend_receives_sdpa_masks(monkeypatch):
    """The "polykv" mask function is sdpa_mask: a 4D boolean mask sized by get_mask_sizes, or None
    where SDPA's is_causal applies (unpadded prefill / single-token decode)."""
    m = tiny_llama()
    seen = []
    orig = KVCache.attend

    def spy(self, module, query, key, value, attention_mask, **kw):
        seen.append((query.shape[2], None if attention_mask is None else
                     (attention_mask.dtype, tuple(attention_mask.shape))))
        return orig(self, module, query, key, value, attention_mask, **kw)

    monkeypatch.setattr(KVCache, "attend", spy)
    ids = torch.randint(1, 97, (2, 10))
    am = torch.ones(2, 10, dtype=torch.long)
    am[0, :3] = 0
    kv_generate(m, input_ids=ids, attention_mask=am, max_new_tokens=3, **GREEDY)
    assert seen[0] == (10, (torch.bool, (2, 1, 10, 10)))
    assert seen[-1] == (1, (torch.bool, (2, 1, 1, 12)))
    seen.clear()
    kv_generate(m, input_ids=ids, max_new_tokens=2, **GREEDY)
    assert seen[0] == (10, None) and seen[-1] == (1, None)


def test_sliding_window_matches_dynamic_and_stays_bounded():
    m = tiny_gemma(window=8)
    ids = torch.randint(1, 97, (1, 30))
    ref = dense_generate(m, input_ids=ids, max_new_tokens=16, **GREEDY)
    out, cache = kv_generate(m, input_ids=ids, max_new_tokens=16, **GREEDY)
    assert torch.equal(ref, out)
    assert [layer.store.length for layer in cache.layers] == [7, 7, 45]
    assert cache.is_sliding == [True, True, False]
    # chunks longer than the window: the chunk still sees the rows the trim drops afterwards
    x = torch.randint(1, 97, (1, 50))
    assert_matches_reference(m, x, "f16", "f16", step=12)
    assert_matches_reference(m, x, "q8_0", "turbo3", step=12)


def test_sliding_layers_hold_their_window_not_the_prompt():
    """After a long prompt, a sliding layer's storage is its window plus one row (it held the
    prompt's length), and decoding still matches transformers."""
    m = tiny_gemma(window=8)
    ids = torch.randint(1, 97, (1, 300))
    ref = dense_generate(m, input_ids=ids, max_new_tokens=4, **GREEDY)
    out, cache = kv_generate(m, k="q8_0", v="q8_0", input_ids=ids, max_new_tokens=4, **GREEDY)
    assert torch.equal(ref, out)
    sliding = [lay.store.capacity for lay in cache.layers if lay.is_sliding]
    assert sliding and all(c == 7 + 1 for c in sliding)
    assert all(lay.store.capacity >= 303 for lay in cache.layers if not lay.is_sliding)


def test_mask_sizes_mirror_dynamic_sliding_layer():
    m = tiny_gemma(window=8)
    dyn, kv = DynamicCache(config=m.config), KVCache(m, "f16", "f16")
    m.set_attn_implementation("polykv")
    x = torch.randint(1, 97, (1, 23))
    with torch.inference_mode():
        for s in (0, 5, 6, 13):
            e = {5: 5, 0: 5, 6: 7, 13: 10}[s]
            for c in (dyn, kv):
                m(input_ids=x[:, s:s + e], past_key_values=c)
            for layer in range(3):
                for q in (1, 9):
                    assert kv.get_mask_sizes(q, layer) == dyn.get_mask_sizes(q, layer)
                assert kv.get_seq_length(layer) == dyn.get_seq_length(layer)


@pytest.mark.parametrize("k,v", [("q8_0", "turbo3"), ("turbo4", "turbo3"), ("q4_0", "turbo2"),
                                 ("turbo8", "q8_0"), ("bf16", "turbo4"), ("turbo2", "q4_0")])
def test_compressed_types_match_fake_quant_reference(k, v):
    """Every chunk's logits equal a DynamicCache holding the codec's decoded rows (tight), while they
    differ from plain f16 rows by far more than that tolerance (the compression is real)."""
    m = tiny_llama()
    x = torch.randint(1, 97, (1, 40))
    ref, got = assert_matches_reference(m, x, k, v)
    assert_far(chunked_logits(m, DynamicCache(config=m.config), x, 8), got, ref)


def test_rotated_attention_equals_true_space():
    m = tiny_llama()
    x = torch.randint(1, 97, (1, 30))
    a = chunked_logits(m, KVCache(m, "turbo4", "turbo3", rotated_attention=True), x, 10)
    b = chunked_logits(m, KVCache(m, "turbo4", "turbo3", rotated_attention=False), x, 10)
    assert_matches_reference(m, x, "turbo4", "turbo3", step=10)  # b is bit-identical to the reference
    err = (a - b).abs()
    assert float((err <= REF_ATOL).float().mean()) >= 0.9 and float(err.max()) <= 1e-3


def test_innerq_table_applies_to_turbo_keys_only(tmp_path):
    from polykv.hf.capture import calibrate_innerq, capture_kv

    m = skew_keys(tiny_llama())
    x = torch.randint(1, 97, (40,))
    kv = capture_kv(m, None, [x], max_tokens=32)
    assert set(kv) == {0, 1, 2} and kv[0][0].shape == (1, 2, 32, 32)
    # a deliberately unbalanced table so that every layer has scales
    table = InnerQTable(scales={i: torch.linspace(0.5, 2.0, 32).repeat(2, 1) for i in range(3)})
    c = KVCache(m, "turbo4", "turbo3", innerq=table)
    assert c.innerq is table
    assert all(torch.equal(layer.key_scales, table.layer(i)) for i, layer in enumerate(c.layers))
    assert KVCache(m, "q8_0", "turbo3", innerq=table).layers[0].key_scales is None
    # keys stored as K*s, queries q/s: equal to the reference that quantizes K*s and divides by s,
    # in the rotated domain and in true space; and different from the same cache without InnerQ
    ref, got = assert_matches_reference(m, x[None], "turbo4", "turbo3", innerq=table)
    assert_far(chunked_logits(m, FakeQuantCache(m, "turbo4", "turbo3"), x[None], 8), got, ref)
    # q8_0 K ignores the table: same logits as without it
    torch.testing.assert_close(chunked_logits(m, KVCache(m, "q8_0", "turbo3", innerq=table), x[None], 8),
                               chunked_logits(m, KVCache(m, "q8_0", "turbo3"), x[None], 8), atol=0, rtol=0)
    path = tmp_path / "t.safetensors"
    saved = calibrate_innerq(m, None, [x], max_tokens=32, path=path)
    assert path.exists() and sorted(saved.scales) == [0, 1, 2]  # the skewed keys need scales everywhere
    loaded = KVCache(m, "turbo3", "turbo3", innerq=path).innerq
    assert sorted(loaded.scales) == [0, 1, 2]
    for i in range(3):
        torch.testing.assert_close(loaded.scales[i], saved.scales[i], atol=0, rtol=0)


def test_innerq_auto_uses_cache_dir(tmp_path, monkeypatch):
    from polykv.hf.capture import calibrate_innerq

    from polykv.hf.kv_cache import innerq_path

    monkeypatch.setenv("POLYKV_CACHE_DIR", str(tmp_path))
    m = skew_keys(tiny_llama())
    assert KVCache(m, "turbo3", "turbo3", innerq="auto").innerq is None  # nothing calibrated yet
    saved = calibrate_innerq(m, None, [torch.randint(1, 97, (64,))])
    assert list((tmp_path / "innerq").glob("*.safetensors")) == [innerq_path(m)]
    c = KVCache(m, "turbo3", "turbo3", innerq="auto")
    assert isinstance(c.innerq, InnerQTable) and sorted(c.innerq.scales) == [0, 1, 2]
    for i, layer in enumerate(c.layers):
        torch.testing.assert_close(layer.key_scales, saved.scales[i], atol=0, rtol=0)
    # another model (other weights, other fingerprint) finds no table
    assert KVCache(tiny_llama(), "turbo3", "turbo3", innerq="auto").innerq is None


def test_keep_layers_q8():
    m = tiny_llama(layers=5)
    c = KVCache(m, "turbo3", "turbo2", keep_layers_q8=1)
    assert [(layer.k_type, layer.v_type) for layer in c.layers] == (
        [("q8_0", "q8_0")] + [("turbo3", "turbo2")] * 3 + [("q8_0", "q8_0")])
    with pytest.raises(ValueError, match=r"keep_layers_q8 must be in \[0, 5\], got 6"):
        KVCache(m, "turbo3", "turbo2", keep_layers_q8=6)


# bytes per row of one KV head, head_dim 32 (DESIGN §3 table; turbo group G = head_dim = 32)
ROW_BYTES = {"f16": 64, "q8_0": 32 + 2, "turbo3": 32 * 3 // 8 + 2}


def test_bytes_are_measured_and_no_dense_shadow():
    m = tiny_llama()
    x = torch.randint(1, 97, (1, 64))
    for k, v in [("f16", "f16"), ("q8_0", "turbo3")]:
        c = KVCache(m, k, v)
        with torch.inference_mode():
            m(input_ids=x, past_key_values=c)
        rep = c.memory_report()
        # 3 layers x 2 KV heads x 64 rows (the capacity is exactly the 64 tokens here)
        want = 3 * 2 * 64 * (ROW_BYTES[k] + ROW_BYTES[v])
        assert c.nbytes() == rep["kv_bytes"] == rep["kv_bytes_used"] == want and rep["tokens"] == 64
        assert rep["bits_per_value"] == pytest.approx({"f16": 16.0, "q8_0": (8.5 + 3.5) / 2}[k])
        # every tensor reachable from the cache is its packed storage (or a codec's constant
        # codebook): nothing dense survives the forward
        held = {t.untyped_storage().data_ptr() for t in c.tensors()}
        other = [(p, tuple(t.shape)) for p, t in reachable_tensors(c)
                 if t.untyped_storage().data_ptr() not in held and "_codec." not in p]
        assert other == []
        assert sum(t.numel() for p, t in reachable_tensors(c) if "_codec." in p) <= 2 * 16  # codebooks


def test_prefill_holds_exactly_its_rows_and_decode_matches_slack_storage(monkeypatch):
    """After a 131-token prompt every layer holds exactly 131 rows (held bytes = payload; the
    64-row round-up held 192); decode steps then grow the storage and give logits bit-identical to
    a KVCache whose layers reserved ample room before their first write."""
    from polykv.cache import CompressedLayer
    from polykv.hf import kv_cache as kv_mod

    class Slack(CompressedLayer):
        def append(self, k, v):
            self.reserve(512, exact=True)
            super().append(k, v)

    m = tiny_llama()
    ids = torch.randint(1, 97, (1, 131))
    exact, slack = KVCache(m, "q8_0", "turbo3"), KVCache(m, "q8_0", "turbo3")

    def step(x):
        with torch.inference_mode():
            a = m(input_ids=x, past_key_values=exact).logits
            with monkeypatch.context() as mp:
                mp.setattr(kv_mod, "CompressedLayer", Slack)
                b = m(input_ids=x, past_key_values=slack).logits
        assert torch.equal(a, b)
        return a[:, -1:].argmax(-1)

    nxt = step(ids)
    assert [lay.store.capacity for lay in exact.layers] == [131] * 3
    assert [lay.store.capacity for lay in slack.layers] == [512] * 3
    rep = exact.memory_report()
    assert exact.nbytes() == rep["kv_bytes"] == rep["kv_bytes_used"] == 3 * 2 * 131 * (ROW_BYTES["q8_0"] + ROW_BYTES["turbo3"])
    for _ in range(4):
        nxt = step(nxt)
    assert all(lay.store.length == 135 and 135 <= lay.store.capacity < 512 for lay in exact.layers)


def test_reorder_and_select():
    """select / reorder / repeat move whole sequences: the stored rows follow their sequence, and a
    next step gives each row the logits of a fresh cache over that row's own tokens."""
    m = tiny_llama()
    ids = torch.randint(1, 97, (3, 10))
    c = KVCache(m, "q8_0", "turbo3")
    with torch.inference_mode():
        m(input_ids=ids, past_key_values=c)
    rows0 = [layer.store.dense() for layer in c.layers]  # per layer (k, v) [3, kv_heads, 10, D]

    def check(order):
        for layer, (k0, v0) in zip(c.layers, rows0):
            k, v = layer.store.dense()
            assert torch.equal(k, k0[order]) and torch.equal(v, v0[order])

    c.batch_select_indices(torch.tensor([2, 0]))
    check([2, 0])
    c.reorder_cache(torch.tensor([1, 0]))
    check([0, 2])
    c.batch_repeat_interleave(2)
    check([0, 0, 2, 2])
    nxt = torch.randint(1, 97, (4, 1))
    with torch.inference_mode():
        got = m(input_ids=nxt, past_key_values=c).logits[:, -1]
        for b, src in enumerate([0, 0, 2, 2]):
            fresh = KVCache(m, "q8_0", "turbo3")
            m(input_ids=ids[src:src + 1], past_key_values=fresh)
            want = m(input_ids=nxt[b:b + 1], past_key_values=fresh).logits[0, -1]
            torch.testing.assert_close(got[b], want, atol=1e-5, rtol=0)


def test_crop_full_layers():
    m = tiny_llama()
    x = torch.randint(1, 97, (1, 20))
    c = KVCache(m, "q8_0", "turbo3")
    with torch.inference_mode():
        m(input_ids=x, past_key_values=c)
        before = [layer.store.dense() for layer in c.layers]
        c.crop(-5)
        assert c.get_seq_length() == 15
        for layer, (k0, v0) in zip(c.layers, before):
            k, v = layer.store.dense()
            assert torch.equal(k, k0[:, :, :15]) and torch.equal(v, v0[:, :, :15])
        a = m(input_ids=x[:, 15:], past_key_values=c).logits
        fresh = KVCache(m, "q8_0", "turbo3")
        m(input_ids=x[:, :15], past_key_values=fresh)
        b = m(input_ids=x[:, 15:], past_key_values=fresh).logits
        c.crop(-1)
        m(input_ids=x[:, 19:], past_key_values=c)  # the cropped row is written again
        assert c.get_seq_length() == 20
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# --- errors --------------------------------------------------------------------------------------

def test_unknown_type_lists_valid_names():
    m = tiny_llama()
    with pytest.raises(CodecError, match="valid types: f16, bf16, q8_0, q4_0, turbo8"):
        KVCache(m, k="q5_k", v="turbo3")


def test_unsupported_architecture():
    from transformers import T5Config

    class Fake:
        config = T5Config()

    with pytest.raises(UnsupportedModelError, match="unsupported architecture"):
        KVCache(Fake(), "q8_0", "turbo3")
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=64)
    cfg.layer_types = ["full_attention", "linear_attention"]

    class Fake2:
        config = cfg

    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        KVCache(Fake2(), "q8_0", "turbo3")


def test_turbo_head_dim_unsupported_is_clear():
    m = tiny_llama(head_dim=96)
    with pytest.raises(CodecError, match="layer 0 .*head_dim 96.*turbo"):
        KVCache(m, "q8_0", "turbo3")


def test_mismatched_head_dim_is_clear():
    m = tiny_llama()
    c = KVCache(m, "q8_0", "q8_0")
    with pytest.raises(ValueError, match="head_dim 64 does not match the cache layout head_dim 32"):
        c.update(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64), 0)
    with pytest.raises(ValueError, match="KV heads"):
        c.update(torch.randn(1, 3, 4, 32), torch.randn(1, 3, 4, 32), 0)


def test_dynamic_cache_after_kvcache_is_not_hijacked():
    m = tiny_llama()
    x = torch.randint(1, 97, (1, 12))
    with torch.inference_mode():
        m(input_ids=x, past_key_values=KVCache(m, "turbo2", "turbo2"))
        a = m(input_ids=x, past_key_values=DynamicCache()).logits  # still the "polykv" attention
        m.set_attn_implementation("sdpa")
        b = m(input_ids=x, past_key_values=DynamicCache()).logits
    assert torch.equal(a, b)


# --- real models ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from polykv.hf.loading import load_model

    return load_model("smollm2-135m")


@pytest.mark.model
def test_smollm2_f16_generate_identical(smollm2):
    m, tok = smollm2
    enc = tok(["The capital of France is", "Once upon a time, in a small village by the sea, there"],
              return_tensors="pt", padding=True)
    ref = dense_generate(m, **enc, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    out, _ = kv_generate(m, **enc, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(ref, out)


@pytest.mark.model
def test_smollm2_q8_turbo3_bytes(smollm2):
    m, tok = smollm2
    x = torch.tensor([tok("It is a truth universally acknowledged, that a single man")["input_ids"] * 12])
    sizes = {}
    for k, v in [("f16", "f16"), ("q8_0", "turbo3")]:
        c = KVCache(m, k, v)
        with torch.inference_mode():
            m(input_ids=x, past_key_values=c, logits_to_keep=1)
        c.compact()
        sizes[k] = c.nbytes()
    assert sizes["f16"] / sizes["q8_0"] >= 2.7


@pytest.mark.model
@pytest.mark.slow
def test_gemma3_f16_generate_identical_past_window():
    from polykv.hf.loading import load_model

    m, tok = load_model("gemma3-270m")
    from polykv.eval.common import load_text

    x = torch.tensor([tok(load_text(None)[:20000])["input_ids"][:600]])
    assert x.shape[1] == 600
    ref = dense_generate(m, input_ids=x, max_new_tokens=16, do_sample=False)
    out, cache = kv_generate(m, input_ids=x, max_new_tokens=16, do_sample=False)
    assert torch.equal(ref, out)
    w = m.config.sliding_window
    assert all(layer.store.length <= w - 1 for layer in cache.layers if layer.is_sliding)



def script_model(n_ids: int) -> str:
    """The head of a fresh-process script (Triton's interpreter is fixed at import): a seeded
    2-layer random Llama `model`, `ids` [1, n_ids], and `calls`, one entry per attention_decode."""
    return r"""
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
import polykv.hf.kv_cache as kvc
from polykv.hf import DecodeGraph
from polykv.hf.kv_cache import KVCache
from polykv.kernels import dispatch

cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=300)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 300, (1, %d))
calls = []
real = dispatch.attention_decode
dispatch.attention_decode = lambda *a, **k: calls.append(1) or real(*a, **k)
""" % n_ids


_FUSED_SCRIPT = script_model(40) + r"""
def decode_logits():
    cache = KVCache(model, k="q8_0", v="turbo3")
    with torch.inference_mode():
        model(ids[:, :36], past_key_values=cache, use_cache=True)
        return torch.stack([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0, -1]
                            for t in range(36, 40)])

fused = decode_logits()          # Triton kernels through the interpreter
n_fused = len(calls)
dispatch.force_reference(True)   # same gate, the torch reference on the same packed data
ref = decode_logits()
print(json.dumps({"calls": n_fused, "rel": float((fused - ref).norm() / ref.norm()),
                  "same_argmax": bool(torch.equal(fused.argmax(-1), ref.argmax(-1)))}))
"""


def test_fused_decode_path_through_kernels():
    """The decode gate (n_q <= 8) sends every decode step of every layer to the fused kernel
    (here Triton's interpreter, in a fresh process: TRITON_INTERPRET must be set before triton is
    imported) and its logits match the reference on the same packed cache."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, POLYKV_TRITON_ON_CPU="1", TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _FUSED_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["calls"] == 4 * 2  # 4 decode steps x 2 layers
    assert out["rel"] < 2e-2, out  # the kernel multiplies in fp16 (DESIGN gate: 1e-2 per attention)
    assert out["same_argmax"]

"""Prefill attention: the split path (history + causal chunk by flash kernels, merged by LSE, no
[C, L] mask) equals the masked reference `prefill_attention`. On CPU the split path runs aten's CPU
flash kernel, so the same code that runs on CUDA (less the kernels) is exercised here."""

import importlib.util
import math

import pytest
import torch

from polykv.cache.layer import CompressedLayer
from polykv.pool import SharedKVPool
from polykv.pool.agent_cache import dummy_mask
from polykv.pool.attention import flash_attention_lse, prefill_attention, prefill_attention_split
from polykv.pool.prefill import PrefillCache, _decode_hist, _decode_true, prefill_path

from .conftest import CharTok, tiny_gemma, tiny_llama


def _rand(Hq, Hkv, C, L, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return r(1, Hq, C, D), r(1, Hkv, L, D), r(1, Hkv, L, D), r(1, Hkv, C, D), r(1, Hkv, C, D)


def test_flash_lse_is_natural_log_and_causal():
    q, k, v = torch.randn(1, 3, 6, 16), torch.randn(1, 3, 6, 16), torch.randn(1, 3, 6, 16)
    for causal in (False, True):
        out, lse = flash_attention_lse(q, k, v, causal=causal, scale=0.3)
        s = (q @ k.transpose(-1, -2)) * 0.3
        if causal:
            s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -math.inf)
        torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-5, rtol=0)
        torch.testing.assert_close(out, torch.softmax(s, -1) @ v, atol=1e-5, rtol=0)


# (Hq, Hkv, C, L, D): GQA groups 1/3/4, odd chunk and history sizes, empty history (chunk at 0)
SHAPES = [(6, 2, 5, 0, 32), (6, 2, 13, 37, 32), (4, 4, 7, 19, 64), (8, 2, 1, 23, 16),
          (8, 2, 33, 1, 48), (3, 1, 16, 64, 128)]


@pytest.mark.parametrize("Hq,Hkv,C,L,D", SHAPES)
@pytest.mark.parametrize("scaling", [None, 0.11])
def test_split_equals_masked(Hq, Hkv, C, L, D, scaling):
    q, hk, hv, nk, nv = _rand(Hq, Hkv, C, L, D, seed=C * 31 + L)
    kw = dict(scaling=scaling, hist_start=0, pos0=L, window=None)
    ref = prefill_attention(q, hk, hv, nk, nv, **kw)
    out = prefill_attention_split(q, hk, hv, nk, nv, **kw)
    assert out.shape == (1, C, Hq, D)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


def test_split_equals_masked_bf16():
    q, hk, hv, nk, nv = _rand(8, 2, 24, 57, 64, dtype=torch.bfloat16, seed=5)
    kw = dict(scaling=None, hist_start=0, pos0=57, window=None)
    ref = prefill_attention(q.float(), hk.float(), hv.float(), nk.float(), nv.float(), **kw)
    out = prefill_attention_split(q, hk, hv, nk, nv, **kw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("W,L,pos0,C", [(8, 7, 23, 8), (8, 3, 3, 5), (5, 4, 40, 11)])
def test_split_window_layers_equal_masked(W, L, pos0, C):
    """Window layers take the masked path with K/V expanded to Hq (history: the last W-1 rows)."""
    q, hk, hv, nk, nv = _rand(6, 2, C, L, 32, seed=W + L + C)
    kw = dict(scaling=None, hist_start=pos0 - L, pos0=pos0, window=W)
    ref = prefill_attention(q, hk, hv, nk, nv, **kw)
    torch.testing.assert_close(prefill_attention_split(q, hk, hv, nk, nv, **kw), ref,
                               atol=2e-6, rtol=2e-5)


def test_split_refuses_history_that_overlaps_the_chunk():
    q, hk, hv, nk, nv = _rand(4, 2, 4, 9, 32)
    with pytest.raises(ValueError, match="overlap"):
        prefill_attention_split(q, hk, hv, nk, nv, scaling=None, hist_start=0, pos0=5, window=None)


@pytest.mark.parametrize("k,v,innerq", [("q8_0", "turbo3", False), ("turbo4", "q4_0", True),
                                        ("turbo8", "f16", True), ("f16", "turbo2", False)])
def test_decode_hist_equals_decode_true(k, v, innerq):
    """The split path's history decode (dispatch.dequantize; keys / InnerQ in float32) is the
    reference decode, bit for bit in float32 on CPU, and its rounding in bf16."""
    torch.manual_seed(2)
    Hkv, D, L = 2, 64, 29
    scales = torch.rand(Hkv, D) + 0.5 if innerq else None
    layer = CompressedLayer.for_types(k, v, D, 1, Hkv, "cpu", scales)
    layer.append(torch.randn(1, Hkv, L, D), torch.randn(1, Hkv, L, D))
    for stop in (0, 1, 17, L):
        rk, rv = _decode_true(layer, 0, stop)
        dk, dv = _decode_hist(layer, stop, torch.float32)
        assert torch.equal(dk, rk) and torch.equal(dv, rv)
        bk, bv = _decode_hist(layer, stop, torch.bfloat16)
        assert bk.dtype == bv.dtype == torch.bfloat16
        assert torch.equal(bk, rk.bfloat16()) and torch.equal(bv, rv.bfloat16())


def test_auto_path_is_masked_on_cpu_and_split_is_forced():
    cache = PrefillCache([], [])
    q = torch.zeros(1, 2, 3, 32)
    assert not cache.use_split(q)
    with prefill_path("split"):
        assert cache.use_split(q)
        assert not PrefillCache([], [], path="masked").use_split(q)
    assert not cache.use_split(q)
    with pytest.raises(ValueError):
        PrefillCache([], [], path="fast")


def test_pool_chunk_default_depends_on_device(tiny):
    """4096 where the split path runs (CUDA, fp16/bf16 model), else 512 (nothing is allocated on
    the device at construction, so device="cuda" works on a CPU-only machine)."""
    model, tok = tiny
    assert SharedKVPool(model, tok).prefill_chunk == 512
    assert SharedKVPool(model, tok, device="cuda").prefill_chunk == 512  # float32: masked path
    assert SharedKVPool(model, tok, prefill_chunk=64).prefill_chunk == 64
    half = tiny_llama().to(torch.bfloat16)
    assert SharedKVPool(half, tok, device="cuda").prefill_chunk == 4096
    assert SharedKVPool(half, tok).prefill_chunk == 512


DOC = [3 + (i * 37) % 120 for i in range(150)]


def _stored(layers):
    out = []
    for l in layers:
        for p in (l.keys(), l.values()):
            out += [p.codes] + ([p.scales] if p.scales is not None else [])
    return out


def _prefill(model, pool, path, C=16):
    """Prefill DOC through a PrefillCache on `path` by hand (as the pool does), keeping every
    chunk's logits. Returns (logits [len(DOC), vocab], stored tensors)."""
    layers = pool._new_layers()
    cache = PrefillCache(layers, pool._windows, path=path)
    ids, outs = torch.tensor(DOC), []
    with torch.no_grad():
        for a in range(0, len(DOC), C):
            b = min(len(DOC), a + C)
            cache.begin_chunk(a)
            o = model(input_ids=ids[a:b][None], position_ids=torch.arange(a, b)[None],
                      attention_mask=dummy_mask(1, b - a, "cpu"), past_key_values=cache,
                      use_cache=True)
            cache.end_chunk(b)
            outs.append(o.logits[0].float())
    return torch.cat(outs), _stored(layers)


# measured (float32, tiny 3-layer Llama, chunks of 16): logits max |diff| 2.4e-7 (q8_0/turbo3),
# 5.2e-6 (f16); stored code elements differing: 0 (q8_0/turbo3), 0.75% (f16: 1-ulp flips of the
# float16 rounding after ~1e-7 differences upstream). bfloat16: logits max |diff| 7.8e-3 at |logit|
# <= 0.62 (two bf16 ulps).
@pytest.mark.parametrize("k,v,innerq,dtype,atol,max_frac", [
    ("q8_0", "turbo3", False, torch.float32, 2e-5, 0.005),
    ("turbo4", "q8_0", True, torch.float32, 2e-5, 0.005),
    ("f16", "f16", False, torch.float32, 2e-5, 0.02),
    ("q8_0", "turbo3", False, torch.bfloat16, 3e-2, None),
])
def test_prefill_split_matches_masked(k, v, innerq, dtype, atol, max_frac):
    """Every chunk's logits of a whole prefill through the split path equal the masked path's
    (each chunk attends to the compressed history, so errors would compound over the 10 chunks);
    in float32 the stored compressed rows are (nearly) the same elements."""
    from polykv.codecs import InnerQTable

    model = tiny_llama(seed=1, layers=3).to(dtype)
    table = InnerQTable(scales={i: torch.rand(2, 32) + 0.5 for i in range(3)}) if innerq else None
    pool = SharedKVPool(model, CharTok(), k=k, v=v, innerq=table, progress=False)
    la, sa = _prefill(model, pool, "masked")
    lb, sb = _prefill(model, pool, "split")
    torch.testing.assert_close(lb, la, atol=atol, rtol=0)
    if max_frac is not None:
        diff = sum(int((x != y).sum()) for x, y in zip(sa, sb))
        assert diff <= max_frac * sum(x.numel() for x in sa), diff


def _next_logits(pool, doc, suffix=(5, 6, 7)):
    with pool.open_batch(doc) as b:
        a = b.add(list(suffix))
        return b.step()[a]


def test_pool_add_document_split_matches_masked():
    """Through the pool (`prefill_path` switch): the same stored bytes (measured: identical) and
    next-token logits of an agent over the document within 1e-5."""
    model = tiny_llama(seed=1, layers=3)
    pools, doc = {}, None
    for path in ("masked", "split"):
        pools[path] = SharedKVPool(model, CharTok(), k="q8_0", v="turbo3", prefill_chunk=16)
        with prefill_path(path):
            doc = pools[path].add_document(DOC)
    a, b = (_stored(pools[p]._docs[doc].layers) for p in ("masked", "split"))
    diff = sum(int((x != y).sum()) for x, y in zip(a, b))
    assert diff <= 0.005 * sum(x.numel() for x in a), diff
    la, lb = _next_logits(pools["masked"], doc), _next_logits(pools["split"], doc)
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=0)


def test_pool_prefill_split_matches_full_forward_f16():
    """f16 storage: the split-path prefill reproduces a plain forward (chunks of 7: every chunk
    boundary case, incl. GQA and a last partial chunk)."""
    model = tiny_llama(seed=2)
    pool = SharedKVPool(model, CharTok(), k="f16", v="f16", prefill_chunk=7)
    with prefill_path("split"):
        doc = pool.add_document(DOC)
    with torch.no_grad():
        ref = model(torch.tensor([DOC + [5, 6, 7]])).logits[0, -1]
    torch.testing.assert_close(_next_logits(pool, doc), ref, atol=1e-3, rtol=0)


def test_pool_prefill_split_sliding_window_layers():
    """Gemma-3-style sliding layers through the split path (window layers: masked with expanded
    K/V; the full layer: split) reproduce a plain forward with f16 storage."""
    model = tiny_gemma(heads=4, kv_heads=2)
    pool = SharedKVPool(model, CharTok(), k="f16", v="f16", prefill_chunk=5)
    doc_ids = list(range(3, 40))
    with prefill_path("split"):
        doc = pool.add_document(doc_ids)
    assert pool._docs[doc].layers[0].length == 7
    with torch.no_grad():
        ref = model(torch.tensor([doc_ids + [5, 6, 7]])).logits[0, -1]
    torch.testing.assert_close(_next_logits(pool, doc), ref, atol=1e-3, rtol=0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("k,v,innerq", [("q8_0", "turbo3", False), ("turbo4", "q4_0", True)])
def test_split_path_with_triton_kernels(monkeypatch, k, v, innerq):
    """The CUDA composition on CPU: history decoded by the Triton dequant kernel and the LSE merge
    by the Triton merge kernel (interpreter, POLYKV_TRITON_ON_CPU=1), flash on CPU; equals the
    reference decode + masked attention."""
    from polykv.kernels import dispatch

    monkeypatch.setenv("POLYKV_TRITON_ON_CPU", "1")
    monkeypatch.delenv("POLYKV_FORCE_REFERENCE", raising=False)
    torch.manual_seed(4)
    Hq, Hkv, D, L, C = 6, 2, 64, 21, 9
    scales = torch.rand(Hkv, D) + 0.5 if innerq else None
    layer = CompressedLayer.for_types(k, v, D, 1, Hkv, "cpu", scales)
    layer.append(torch.randn(1, Hkv, L, D), torch.randn(1, Hkv, L, D))
    assert dispatch.use_triton(layer.k.codes)
    hk, hv = _decode_hist(layer, L, torch.float32)
    rk, rv = _decode_true(layer, 0, L)
    torch.testing.assert_close(hk, rk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hv, rv, atol=1e-5, rtol=1e-5)
    q, nk, nv = torch.randn(1, Hq, C, D), torch.randn(1, Hkv, C, D), torch.randn(1, Hkv, C, D)
    kw = dict(scaling=None, hist_start=0, pos0=L, window=None)
    ref = prefill_attention(q, rk, rv, nk, nv, **kw)
    torch.testing.assert_close(prefill_attention_split(q, hk, hv, nk, nv, **kw), ref, atol=1e-5,
                               rtol=1e-5)

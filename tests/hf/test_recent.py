"""The recent window as storage (KVCache(..., recent=R), polykv/cache/ring.py) on tiny random models:
the materialize path gives the simulation's floats (polykv/eval/anchors.py), the fused path (the
kernels' torch reference here; Triton's interpreter in a subprocess) what a main + ring split must
give, the static decode step what plain fused decoding gives; crop / select / reset keep the ring
right; bytes count it; R = 0 is the cache without a ring."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

import polykv.hf.kv_cache as kvc
from polykv.codecs import InnerQTable, get_codec
from polykv.eval.anchors import AnchoredKVCache, Anchors
from polykv.hf.kv_cache import KVCache
from polykv.presets import PRESETS, recent_for

from .test_decode_graph import decode_static_beside_plain
from .test_kv_cache import FakeQuantCache, chunked_logits, script_model, tiny_gemma, tiny_llama


def innerq_for(model) -> InnerQTable:
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    return InnerQTable({i: 0.5 + 1.5 * torch.rand(cfg.num_key_value_heads, cfg.head_dim, generator=g)
                        for i in range(cfg.num_hidden_layers)})


CASES = [("q8_0", "turbo3", False), ("turbo4", "turbo3", True), ("turbo3", "q4_0", False)]


# --- materialize path = the simulation --------------------------------------------------------

@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma], ids=["llama", "gemma-sliding"])
@pytest.mark.parametrize("k, v, iq", CASES)
@pytest.mark.parametrize("R, step", [(8, 7), (5, 16)])
def test_materialize_equals_the_simulation(make, k, v, iq, R, step):
    """Bit for bit: the ring's q8_0 rows, mapped into the domain attention reads (InnerQ-scaled and
    rotated turbo K, rotated turbo V), are the simulation's anchor rows; chunks longer and shorter
    than R; Gemma's sliding layers (window 8) keep at most window - 1 rows in the ring."""
    m = make()
    table = innerq_for(m) if iq else None
    ids = torch.randint(3, 90, (1, 61), generator=torch.Generator().manual_seed(3))
    ring = KVCache(m, k, v, innerq=table, recent=R)
    got = chunked_logits(m, ring, ids, step)
    sim = chunked_logits(m, AnchoredKVCache(m, k, v, innerq=table, anchors=Anchors(recent=R)), ids, step)
    plain = chunked_logits(m, KVCache(m, k, v, innerq=table), ids, step)
    torch.testing.assert_close(got, sim, atol=0, rtol=0)
    assert (got - plain).abs().max() > 1e-3  # the ring is read (a ring ignored would sit on plain)
    if make is tiny_gemma:
        assert [lay.recent for lay in ring.layers] == [min(R, 7), min(R, 7), R]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma], ids=["llama", "gemma-sliding"])
@pytest.mark.parametrize("k, v, iq", CASES[:2])  # (turbo3 / q4_0 on Gemma: one q4_0 V code of layer 2,
# row 25, flips with the rotation's rounding; the logits after it leaves the ring move by 1.4e-3)
def test_materialize_matches_a_true_space_reference(make, k, v, iq):
    """Independently of the simulation (which shares `attention_domain`): the rotated-domain
    materialize path with a ring vs plain SDPA over rows faked in true space (`RingReference`) —
    equal up to rotation rounding, as `assert_matches_reference` allows (>= 90 % of the logits
    within 1e-5, none beyond 1e-3). A ring row left out of the InnerQ scaling is off by > 1e-2."""
    m = make()
    table = innerq_for(m) if iq else None
    ids = torch.randint(3, 90, (1, 61), generator=torch.Generator().manual_seed(11))
    ref = chunked_logits(m, RingReference(m, k, v, 8, table), ids, 7)
    got = chunked_logits(m, KVCache(m, k, v, innerq=table, recent=8), ids, 7)
    err = (got - ref).abs()
    assert float((err <= 1e-5).float().mean()) >= 0.9 and float(err.max()) <= 1e-3, \
        (float((err > 1e-5).float().mean()), float(err.max()))


def test_recent_zero_is_the_cache_without_a_ring():
    """R = 0: no ring tensors, the same bytes and bit-identical logits as before rings existed (the
    true-space path is the FakeQuantCache reference exactly, as tests/hf/test_kv_cache.py checks)."""
    m = tiny_llama()
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(4))
    for k, v, iq in CASES:
        table = innerq_for(m) if iq else None
        zero = KVCache(m, k, v, innerq=table, recent=0, rotated_attention=False)
        a = chunked_logits(m, zero, ids, 8)
        b = chunked_logits(m, FakeQuantCache(m, k, v, table), ids, 8)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        assert all(lay.ring is None for lay in zero.layers) and zero.recent == 0
        other = KVCache(m, k, v, innerq=table)
        chunked_logits(m, other, ids, 8)
        assert zero.nbytes() == other.nbytes() and len(zero.tensors()) == len(other.tensors())


# --- fused path --------------------------------------------------------------------------------

class RingReference(DynamicCache):
    """What a KVCache with a ring must attend to, from exact rows kept here (plain SDPA, true space).
    materialize (fused=False): rows before the chunk at positions < P - r through the layer codec,
    the r = min(R, P) before it through q8_0, the chunk's own rows exact. fused=True: every row
    stored, [0, L - r) layer codec and [L - r, L) q8_0 with r = min(R, L) (the chunk in the ring)."""

    def __init__(self, model, k, v, R, innerq=None):
        super().__init__(config=model.config)
        d = model.config.head_dim
        self.kc, self.vc, self.q8 = get_codec(k, d), get_codec(v, d), get_codec("q8_0", d)
        self.innerq, self.fused, self.exact = innerq, False, {}
        w = getattr(model.config, "sliding_window", None)
        types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
        self.R = [min(R, w - 1) if t == "sliding_attention" else R for t in types]

    def _codec(self, x, codec, scales=None):
        if x.shape[2] == 0:
            return x
        if scales is None:
            return codec.decode(codec.encode(x))
        return codec.decode(codec.encode(x * scales[None, :, None, :])) / scales[None, :, None, :]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = key_states.float(), value_states.float()
        ex = self.exact.get(layer_idx)
        ek, ev = (k, v) if ex is None else (torch.cat([ex[0], k], 2), torch.cat([ex[1], v], 2))
        self.exact[layer_idx] = (ek, ev)
        ret_k, _ = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        n, L, R = k.shape[2], ek.shape[2], self.R[layer_idx]
        s = self.innerq.layer(layer_idx) if self.innerq is not None and self.kc.rotated else None
        end = L if self.fused else L - n
        r = min(R, end)
        parts_k = [self._codec(ek[:, :, :end - r], self.kc, s), self._codec(ek[:, :, end - r:end], self.q8)]
        parts_v = [self._codec(ev[:, :, :end - r], self.vc), self._codec(ev[:, :, end - r:end], self.q8)]
        if not self.fused:
            parts_k.append(k)
            parts_v.append(v)
        fk, fv = torch.cat(parts_k, 2), torch.cat(parts_v, 2)
        keep = ret_k.shape[2]  # a sliding layer returns its kept rows + the chunk
        return fk[:, :, L - keep:].to(key_states.dtype), fv[:, :, L - keep:].to(value_states.dtype)


def decode_run(m, cache, ids, prefill, n):
    out = []
    with torch.inference_mode():
        m(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True)
        if isinstance(cache, RingReference):
            cache.fused = True
        for t in range(prefill, ids.shape[1] - n + 1, n):
            out.append(m(input_ids=ids[:, t:t + n], past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(out)


@pytest.mark.parametrize("make, n", [(tiny_llama, 1), (tiny_llama, 3), (tiny_gemma, 1)],
                         ids=["llama-1", "llama-3", "gemma-1"])
@pytest.mark.parametrize("k, v, iq", CASES)
def test_fused_path_reads_main_then_ring(make, n, k, v, iq, monkeypatch):
    """Decode steps through `_attend_fused` (the kernels' torch reference on CPU) after a prefill
    shorter than the ring (the first steps have no main segment, then the ring wraps): main rows in
    the layer codec + the last R rows (this step's included) at q8_0, merged by LSE. Prefill
    through the materialize path (10 tokens > FUSED_MAX_QUERIES; its own semantics, also checked here)."""
    m = make()
    table = innerq_for(m) if iq else None
    ids = torch.randint(3, 90, (1, 10 + 12 * n), generator=torch.Generator().manual_seed(5))
    ref = decode_run(m, RingReference(m, k, v, 12, table), ids, 10, n)
    calls = []
    real = KVCache._attend_ring
    monkeypatch.setattr(KVCache, "_attend_ring", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(kvc, "_fused_available", lambda q: True)
    got = decode_run(m, KVCache(m, k, v, innerq=table, recent=12, rotated_attention=False), ids, 10, n)
    plain = decode_run(m, KVCache(m, k, v, innerq=table, rotated_attention=False), ids, 10, n)
    assert len(calls) == 12 * len(m.model.layers)  # every decode step of every layer took the ring path
    err = (got - ref).abs()
    assert float(err.max()) < 1e-4, float(err.max())  # einsum vs SDPA rounding (measured <= 4.3e-6)
    assert float((plain - ref).abs().max()) > 30 * max(float(err.max()), 1e-5)


def test_fused_gate_sends_long_chunks_to_materialize(monkeypatch):
    """A chunk longer than R (the main segment would not be wholly before every query), and a
    multi-query chunk on a sliding layer, take the materialize path."""
    m = tiny_gemma()
    monkeypatch.setattr(kvc, "_fused_available", lambda q: True)
    fused = []
    real = KVCache._attend_fused
    monkeypatch.setattr(KVCache, "_attend_fused", lambda self, layer, *a, **kw: fused.append(layer.layout.index)
                        or real(self, layer, *a, **kw))
    cache = KVCache(m, "q8_0", "turbo3", recent=4)
    ids = torch.randint(3, 90, (1, 30))
    with torch.inference_mode():
        m(input_ids=ids[:, :12], past_key_values=cache)
        m(input_ids=ids[:, 12:17], past_key_values=cache)  # 5 > R = 4
        assert fused == []
        m(input_ids=ids[:, 17:20], past_key_values=cache)  # 3 <= 4: the full layer only
        assert fused == [2]
        m(input_ids=ids[:, 20:21], past_key_values=cache)
        assert fused == [2, 0, 1, 2]


# --- static (captured) decode step ------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 2])
def test_static_decode_with_ring_matches_plain_fused(batch, monkeypatch):
    """DecodeGraph's static step (device lengths, ring order gathered on the device, no host
    value) equals plain fused decoding; the prompt is shorter than R, so the steps cross the
    ring's first wrap and the start of the main segment."""
    monkeypatch.setattr(kvc, "_fused_available", lambda q: True)
    m = tiny_llama(layers=2)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 90, (batch, 5), generator=g)
    steps = torch.randint(3, 90, (14, batch, 1), generator=g)
    plain = [KVCache(m, "turbo4", "turbo3", innerq=innerq_for(m), recent=8) for _ in range(batch)]
    static = KVCache(m, "turbo4", "turbo3", innerq=innerq_for(m), recent=8)
    calls = []
    real = KVCache._attend_ring
    monkeypatch.setattr(KVCache, "_attend_ring", lambda self, layer, q, s, rows, end, ks: calls.append(
        isinstance(end, torch.Tensor)) or real(self, layer, q, s, rows, end, ks))
    decode_static_beside_plain(m, plain, static, ids, steps)
    assert sum(calls) == len(steps) * 2  # the static steps took the device-length ring path
    for i, c in enumerate(plain):
        for a, b in zip(c.layers, static.layers):
            torch.testing.assert_close(a.ring.codec.decode(a.ring.k)[0], b.ring.codec.decode(b.ring.k)[i],
                                       rtol=0, atol=2e-2)


_INTERP_SCRIPT = script_model(48) + r"""
def run(k, v):
    cache = KVCache(model, k=k, v=v, recent=8)
    out = []
    with torch.inference_mode():
        model(ids[:, :5], past_key_values=cache, use_cache=True)   # shorter than the ring: fused, ring only
        for t in range(5, 12):                                       # the ring fills and wraps
            out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0, -1])
        model(ids[:, 12:40], past_key_values=cache, use_cache=True)  # a prefill chunk (materialize)
        for t in (40, 43):                                           # 3-query chunks (a verify step)
            out.extend(model(ids[:, t:t + 3], past_key_values=cache, use_cache=True).logits[0])
        runner = DecodeGraph(model, cache, max_new_tokens=2, capture=False)  # the static step
        for t in (46, 47):
            out.append(runner.step(ids[:, t:t + 1])[0])
    return torch.stack(out)

res = {}
for k, v in (("q8_0", "turbo3"), ("turbo4", "turbo3")):
    calls.clear()
    fused = run(k, v)                    # Triton kernels through the interpreter
    n = len(calls)
    dispatch.force_reference(True)       # the same paths, the torch reference on the same packed data
    gate = kvc._fused_available
    kvc._fused_available = lambda q: True
    ref = run(k, v)
    kvc._fused_available = gate
    dispatch.force_reference(None)
    res[k] = {"calls": n, "rel": float((fused - ref).norm() / ref.norm()),
              "same_argmax": bool(torch.equal(fused.argmax(-1), ref.argmax(-1)))}
print(json.dumps(res))
"""


def test_ring_through_triton_kernels_interpreted():
    """The fused and static ring paths on Triton's kernels (interpreter, fresh process) agree with
    the torch reference on the same packed data within the kernels' fp16 tolerance (measured rel
    5e-4)."""
    env = dict(os.environ, POLYKV_TRITON_ON_CPU="1", TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for r in out.values():
        # per layer: prefill 1 (ring only) + steps 3 x 1 + 4 x 2 + verify 2 x 2 + static 2 x 2
        assert r["calls"] == 2 * (1 + 3 + 8 + 4 + 4), out
        assert r["rel"] < 5e-3, out
        assert r["same_argmax"], out


# --- cache operations --------------------------------------------------------------------------

def ring_rows(layer, start, stop):
    return layer.ring.decode(start, stop)[0]


def test_crop_refills_the_window_from_main_storage():
    m = tiny_llama(layers=2)
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(7))
    cache = KVCache(m, "q8_0", "turbo3", recent=6)
    with torch.inference_mode():
        m(input_ids=ids[:, :26], past_key_values=cache)
    for lay in cache.layers:
        lay.flush_ring()
    before = [ring_rows(lay, 20, 26) for lay in cache.layers]
    with torch.inference_mode():  # (the storage was made in inference mode)
        cache.crop(22)  # 4 rows removed: positions 16..19 re-enter the window, 20, 21 stay
    q8 = get_codec("q8_0", m.config.head_dim)
    for lay, old in zip(cache.layers, before):
        assert lay.cumulative_length == lay.store.length == 22 and lay.ring_rows() == 6
        assert torch.equal(ring_rows(lay, 20, 22), old[:, :, :2])  # untouched
        main_k, _ = lay.store.decode_rows(16, 20)
        assert torch.equal(ring_rows(lay, 16, 20), q8.decode(q8.encode(main_k)))  # re-encoded from main
    with torch.inference_mode():  # decoding on after the crop works and advances both storages
        m(input_ids=ids[:, 22:23], past_key_values=cache)
    assert cache.get_seq_length() == 23


def test_reorder_and_batch_select_move_the_ring():
    m = tiny_llama(layers=2)
    ids = torch.randint(3, 90, (3, 20), generator=torch.Generator().manual_seed(8))
    cache = KVCache(m, "q8_0", "turbo3", recent=8)
    singles = [KVCache(m, "q8_0", "turbo3", recent=8) for _ in range(3)]
    with torch.inference_mode():
        m(input_ids=ids[:, :16], past_key_values=cache)
        for i, c in enumerate(singles):
            m(input_ids=ids[i:i + 1, :16], past_key_values=c)
        cache.reorder_cache(torch.tensor([2, 0, 1]))
        cache.batch_select_indices(torch.tensor([0, 2]))  # sequences 2 and 1
        got = m(input_ids=ids[[2, 1], 16:17], past_key_values=cache).logits[:, -1]
        want = torch.cat([m(input_ids=ids[i:i + 1, 16:17], past_key_values=singles[i]).logits[:, -1]
                          for i in (2, 1)])
    assert cache.layers[0].ring.batch == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reset_starts_the_ring_over():
    m = tiny_llama(layers=2)
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(9))
    cache = KVCache(m, "turbo4", "turbo3", recent=8)
    chunked_logits(m, cache, ids, 7)
    cache.reset()
    assert all(lay.ring_rows() == 0 for lay in cache.layers)
    again = chunked_logits(m, cache, ids[:, :10], 4)
    fresh = chunked_logits(m, KVCache(m, "turbo4", "turbo3", recent=8), ids[:, :10], 4)
    torch.testing.assert_close(again, fresh, atol=0, rtol=0)


# --- bytes and presets -------------------------------------------------------------------------

def test_bytes_count_the_ring():
    m = tiny_gemma()  # sliding layers: rings of window - 1 = 7 rows, the full layer R
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(10))
    with_ring, without = KVCache(m, "q8_0", "turbo3", recent=16), KVCache(m, "q8_0", "turbo3")
    chunked_logits(m, with_ring, ids, 8)
    chunked_logits(m, without, ids, 8)
    hd, kv = m.config.head_dim, m.config.num_key_value_heads
    row = hd + 2 * (hd // 32)  # q8_0 bytes per row
    ring_bytes = sum(2 * kv * r * row for r in (7, 7, 16))
    assert with_ring.nbytes() - without.nbytes() == ring_bytes
    rep, base = with_ring.memory_report(), without.memory_report()
    assert rep["kv_bytes"] == with_ring.nbytes() and rep["recent"] == 16 and base["recent"] == 0
    assert rep["kv_bytes_used"] - base["kv_bytes_used"] == ring_bytes  # every slot written by now
    assert [r["ring_bytes"] for r in rep["per_layer"]] == [2 * kv * r * row for r in (7, 7, 16)]
    assert rep["bits_per_value"] > base["bits_per_value"]
    from polykv.cache import storage_bytes
    assert storage_bytes(with_ring.tensors()) == with_ring.nbytes()


def test_preset_recent_and_overrides():
    assert recent_for(None) == PRESETS["default"].recent
    assert recent_for("balanced") == PRESETS["balanced"].recent
    assert recent_for("max", recent=3) == 3
    assert recent_for(None, k="q8_0", v="turbo3") == 0  # explicit types, no preset: no window
    assert recent_for("balanced", k="turbo4") == PRESETS["balanced"].recent  # a named preset keeps its R
    with pytest.raises(ValueError):
        recent_for(None, recent=-1)
    m = tiny_llama(layers=1)
    assert KVCache(m, k="q8_0", v="turbo3", recent=12).layers[0].recent == 12
    assert KVCache(m, preset="max", precision=None).recent == PRESETS["max"].recent
    assert KVCache(m, k="q8_0", v="turbo3").recent == 0
    with pytest.raises(ValueError, match="ring"):
        AnchoredKVCache(m, k="q8_0", v="turbo3", anchors=Anchors(recent=4), recent=4)

"""Presets (DESIGN §5): names resolve to K/V types, k=/v= override, and the measured bytes of each
preset meet issue K's byte gates against an f16 cache (quality gates: `polykv eval tiers`)."""

import pytest
import torch

import polykv
from polykv.presets import PRESETS, resolve

from .pool.conftest import CharTok


def _model(head_dim=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def test_resolve_and_overrides():
    assert resolve(None, None, None) == ("q8_0", "turbo3", None)
    assert resolve("max", None, None) == ("turbo3", "turbo2", "auto")
    assert resolve("balanced", "q8_0", None, None) == ("q8_0", "turbo3", "auto")
    with pytest.raises(ValueError, match="unknown preset"):
        resolve("fast", None, None)


@pytest.mark.parametrize("name,gate", [("default", 2.7), ("balanced", 3.5), ("max", 5.0)])
def test_preset_bytes_vs_f16(name, gate):
    """Held bytes after a 2,047-token prompt (exact allocation; the gates are at 2k, where the
    recent ring's fixed R rows per layer are counted), measured from the tensors."""
    model = _model()
    ids = torch.randint(3, 120, (1, 2047))
    caches = {}
    with torch.no_grad():
        for key, kw in (("f16", dict(k="f16", v="f16")), (name, dict(preset=name))):
            caches[key] = polykv.KVCache(model, **kw)
            model(ids, past_key_values=caches[key], use_cache=True)
    p = PRESETS[name]
    assert (caches[name].k_type, caches[name].v_type) == (p.k, p.v)
    assert caches[name].recent == p.recent and all(lay.ring is not None for lay in caches[name].layers)
    ratio = caches["f16"].nbytes() / caches[name].nbytes()
    assert ratio >= gate, (name, ratio)


def test_pool_preset_and_override():
    model = _model()
    pool = polykv.SharedKVPool(model, CharTok(), preset="max", progress=False)
    assert (pool.k_type, pool.v_type) == ("turbo3", "turbo2")
    assert pool.innerq is None  # "auto" and no calibrated table for this random model
    pool = polykv.SharedKVPool(model, CharTok(), preset="balanced", v="q8_0", progress=False)
    assert (pool.k_type, pool.v_type) == ("turbo4", "q8_0")


def test_serve_resolves_the_preset(monkeypatch):
    """`polykv serve --preset max` builds its pool with the preset's types (--k/--v override)."""
    import uvicorn

    from polykv.server import runner

    seen = []
    monkeypatch.setattr(runner, "_make_app", lambda **kw: seen.append(kw) or object())
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    runner.serve(preset="max")
    runner.serve(preset="balanced", k="q8_0")
    assert [(s["k"], s["v"], s["innerq"]) for s in seen] == [("turbo3", "turbo2", "auto"),
                                                             ("q8_0", "turbo3", "auto")]


@pytest.mark.parametrize("name,gate", [("balanced", 3.5), ("max", 5.0)])
def test_preset_budget_under_the_byte_gate(name, gate):
    """A calibrated table is allocated at the preset's bits budget: 16 / budget must clear the gate
    (the measured bytes of such a cache: tests/hf/test_precision.py::test_held_bytes_match_chosen_types).
    A preset with a ratio pays for its ring from the table per model (polykv.hf.precision.ratio_budget,
    measured on held bytes in tests/hf/test_precision.py): its ratio is the gate's, bits only a cap."""
    p = PRESETS[name]
    assert p.bits is not None and 16 / p.bits >= gate
    assert PRESETS["default"].bits is None and PRESETS["default"].ratio is None
    if p.ratio is not None:
        assert p.ratio >= gate
    else:  # with the ring's R q8_0 rows (8.5 bits) per 2,047 stored rows at 2k: still over the gate
        assert 16 / (p.bits + p.recent * 8.5 / 2047) >= gate


def test_ratio_preset_on_the_gate_models_shapes():
    """balanced's table budget on SmolLM2's and Gemma-3's shapes (configs only): SmolLM2 keeps the
    cap (4.25), Gemma-3 (sliding layers of 511 rows) pays its ring: 16 / 3.535 - 0.709 = 3.817."""
    from transformers import Gemma3TextConfig, LlamaConfig

    from polykv.hf.kv_cache import model_layout
    from polykv.hf.precision import ratio_budget

    p = PRESETS["balanced"]
    smol = model_layout(LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                    hidden_size=576, head_dim=64))
    gemma = model_layout(Gemma3TextConfig(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                                          head_dim=256, hidden_size=640, sliding_window=512))
    assert min(p.bits, ratio_budget(smol, p.ratio, p.recent)) == p.bits
    assert ratio_budget(gemma, p.ratio, p.recent) < p.bits - 0.3

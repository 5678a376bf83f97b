"""Per-layer K/V types in the shared pool (issue K): `SharedKVPool(preset="balanced" | "max")` takes the
model's calibrated precision table like `KVCache` does, `overrides=` sets layers by hand; documents,
agent suffixes, memory accounting and the store follow every layer's own pair."""

from __future__ import annotations

import json

import pytest
import torch

from polykv.codecs import get_codec
from polykv.hf.precision import precision_path
from polykv.pool import PoolFormatError, SharedKVPool
from polykv.presets import PRESETS
from tests.hf.test_precision import _model, _model_table
from tests.pool.conftest import CharTok
from tests.pool.test_persist import current, edit_manifest, read_manifest

DOC = list(range(3, 100)) + list(range(10, 60))  # 147 tokens
PROMPTS = [[5, 6, 7], [8, 9], [40, 41, 42, 43]]


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _doc_types(pool, doc) -> list[tuple[str, str]]:
    """(k, v) codec names actually stored per layer of a document (by the codecs' own identity)."""
    names = {}
    for lay, s in zip(pool._docs[doc].layers, pool.layout):
        for kt in ("f16", "q8_0", "turbo2", "turbo3", "turbo4"):
            c = get_codec(kt, s.head_dim)
            names.setdefault(s.index, [None, None])
            if type(c) is type(lay.k_codec) and c.code_bytes == lay.k_codec.code_bytes:
                names[s.index][0] = kt
            if type(c) is type(lay.v_codec) and c.code_bytes == lay.v_codec.code_bytes:
                names[s.index][1] = kt
    return [tuple(names[s.index]) for s in pool.layout]


def _packed_bytes(types, layout, rows) -> int:
    """Bytes of `rows` rows per layer stored as `types`: DESIGN §3 codes + fp16 scales per row."""
    total = 0
    for (kt, vt), s in zip(types, layout):
        for t in (kt, vt):
            c = get_codec(t, s.head_dim)
            total += s.num_kv_heads * rows * (c.code_bytes + 2 * c.n_scales)
    return total


def test_pool_preset_takes_the_calibrated_table(cache_dir):
    model, tok = _model(), CharTok()
    fixed = SharedKVPool(model, tok, preset="balanced")
    assert fixed.precision["source"] == "fixed" and len(set(fixed.layer_types)) == 1
    table = _model_table(model)
    table.save(precision_path(model))
    for name in ("balanced", "max"):
        want = list(table.allocate(PRESETS[name].bits).types)
        assert len(set(want)) > 1  # a real mix
        pool = SharedKVPool(model, tok, preset=name)
        assert pool.precision["source"] == "calibrated" and pool.layer_types == want
        doc = pool.add_document(DOC)
        assert _doc_types(pool, doc) == want
        # the shared prefix holds exactly what the chosen types cost, layer by layer
        assert pool.memory_report()["kv_bytes_shared"] == _packed_bytes(want, pool.layout, len(DOC))
        assert pool.memory_report()["precision"]["source"] == "calibrated"
        for kw in (dict(precision=None), dict(k="turbo4"), dict(overrides={0: ("q8_0", "q8_0")})):
            p2 = SharedKVPool(model, tok, preset=name, **kw)
            assert p2.precision["source"] == "fixed", kw
    assert SharedKVPool(model, tok).precision is None  # no preset asked
    # the pool's own recent= is the ring balanced's budget pays for
    from polykv.hf.precision import preset_policy

    _, want_info = preset_policy(model, "balanced", table, recent=300)
    own = SharedKVPool(model, tok, preset="balanced", recent=300)
    assert own.recent == 300 and own.precision["ring"] == want_info["ring"]
    assert own.precision["bits_target"] == want_info["bits_target"]


def test_mixed_layers_generate_like_the_same_overrides(cache_dir):
    """Agents' suffix pages and the cascade follow each layer's pair: a calibrated pool answers exactly
    as a pool given the same per-layer types by hand, and not as the uniform pool."""
    model, tok = _model(), CharTok()
    table = _model_table(model)
    table.save(precision_path(model))
    cal = SharedKVPool(model, tok, preset="max")
    hand = SharedKVPool(model, tok, k="turbo3", v="turbo2", innerq=None,
                        overrides=dict(enumerate(cal.layer_types)), recent=cal.recent)
    assert hand.layer_types == cal.layer_types
    logits = []
    for pool in (cal, hand, SharedKVPool(model, tok, preset="max", precision=None)):
        doc = pool.add_document(DOC)
        pool.generate(doc, PROMPTS, max_new_tokens=8, chat_template=False)  # runs end to end
        with pool.open_batch(doc, capacity=4) as b, torch.no_grad():
            for p in PROMPTS:
                b.add(p)
            b._run_pending()  # the suffixes go into their pages
            b.feed({a: 50 + a for a in b.agents()})
            (_, out, _), = b._run_pending()  # a decode step: cascade over prefix + suffix pages
            logits.append(out.float().clone())
            # suffix pages per layer in that layer's codecs
            for st, lay in zip(b.cache.store, pool._docs[doc].layers):
                assert st.k_codec is lay.k_codec and st.v_codec is lay.v_codec
    assert torch.equal(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2])  # the types matter: the comparison can fail


def test_per_layer_types_survive_the_store(cache_dir, tmp_path):
    model, tok = _model(), CharTok()
    _model_table(model).save(precision_path(model))
    pool = SharedKVPool(model, tok, preset="balanced")
    doc = pool.add_document(DOC)
    pool.generate(doc, PROMPTS, max_new_tokens=6, chat_template=False)
    before = pool.last_generate["answer_ids"]
    store = tmp_path / "store"
    pool.save(store)
    m = read_manifest(store)
    assert m["codec"]["layers"] == [list(t) for t in pool.layer_types]
    loaded = SharedKVPool.load(store, model, tok)
    assert loaded.layer_types == pool.layer_types and _doc_types(loaded, doc) == pool.layer_types
    loaded.generate(doc, PROMPTS, max_new_tokens=6, chat_template=False)
    assert loaded.last_generate["answer_ids"] == before
    # a uniform pool writes no per-layer field (stores of earlier versions load unchanged)
    plain = SharedKVPool(model, tok, k="q8_0", v="turbo3")
    plain.add_document(DOC)
    plain.save(tmp_path / "plain")
    assert "layers" not in read_manifest(tmp_path / "plain")["codec"]
    # a per-layer field that does not fit the model is refused by name
    edit_manifest(store, lambda mm: mm["codec"].update(layers=mm["codec"]["layers"][:-1]))
    with pytest.raises(PoolFormatError, match="codec.layers"):
        SharedKVPool.load(store, model, tok)
    assert current(store).exists() and json.loads((current(store) / "manifest.json").read_text())


def test_server_pool_takes_the_preset(cache_dir):
    """`polykv serve --preset balanced` builds its pool through build_pool(preset=...): the calibrated
    per-layer types, as the library gives them."""
    from polykv.server import build_pool

    model, tok = _model(), CharTok()
    table = _model_table(model)
    table.save(precision_path(model))
    pool = build_pool(model, tok, preset="balanced")
    assert pool.precision["source"] == "calibrated"
    assert pool.layer_types == list(table.allocate(PRESETS["balanced"].bits).types)
    assert len(set(build_pool(model, tok, k="turbo4", v="turbo3").layer_types)) == 1

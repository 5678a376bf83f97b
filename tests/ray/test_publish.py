"""polykv.ray.publish without Ray: a document published by one pool is added to another without a
prefill, answers the same, and is refused where `SharedKVPool.load` refuses a save."""

from __future__ import annotations

import pytest
import torch

from polykv.ray.publish import document_id, export_document, import_document, published_documents

from ..engine._models import make_pool, tiny_model

TEXT = "The lighthouse keeper of Varnholm logged eleven ships in the winter of 1911. " * 3


def _counting(pool):
    calls = []
    inner = pool._prefill
    pool._prefill = lambda *a, **kw: (calls.append(1), inner(*a, **kw))[1]
    return calls


@pytest.fixture(scope="module")
def source():
    model, tok = tiny_model()
    pool = make_pool(model, tok)
    doc = pool.add_document(TEXT, name="memo")
    return pool, doc


@pytest.mark.parametrize("via_store", [False, True])
def test_published_document_answers_without_a_prefill(source, via_store, tmp_path):
    pool, doc = source
    src = export_document(pool, doc, store=tmp_path if via_store else None)
    if via_store:
        assert src == str(tmp_path / "docs" / doc)
        assert published_documents(tmp_path) == {doc: {"id": doc, "name": "memo", "tokens": len(pool._docs[doc].ids),
                                                       "path": src}}
    else:
        assert set(src) == {"manifest.json", "pool.safetensors"} and src["pool.safetensors"].dtype.name == "uint8"
    other = make_pool(*tiny_model())
    prefills = _counting(other)
    assert import_document(other, src) == [doc] and prefills == []
    assert document_id(other, TEXT) == doc
    assert other.add_document(TEXT) == doc and prefills == []  # resident: an add finds it
    q = ["How many ships?"]
    assert other.generate(doc, q, max_new_tokens=6) == pool.generate(doc, q, max_new_tokens=6)
    assert other.documents()[0]["bytes"] == pool.documents()[0]["bytes"]
    assert prefills == []


def test_import_refuses_another_model_and_other_codecs(source):
    from transformers import LlamaForCausalLM

    from polykv.pool.pool import PoolFormatError

    pool, doc = source
    src = export_document(pool, doc)
    model, tok = tiny_model()
    torch.manual_seed(1)
    other_model = LlamaForCausalLM(model.config).eval()  # same shapes, other weights
    with pytest.raises(PoolFormatError, match="different model"):
        import_document(make_pool(other_model, tok), src)
    with pytest.raises(PoolFormatError, match="K q8_0 / V turbo3"):
        import_document(make_pool(model, tok, v="turbo4"), src)
    corrupt = dict(src, **{"pool.safetensors": src["pool.safetensors"].copy()})
    corrupt["pool.safetensors"][-1] ^= 0xFF
    with pytest.raises(PoolFormatError, match="sha256"):
        import_document(make_pool(model, tok), corrupt)

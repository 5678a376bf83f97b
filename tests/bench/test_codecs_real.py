import pytest

from polykv.codecs.report import gaussian_table


def test_gaussian_table_fields():
    rows = gaussian_table(head_dim=64, rows=256)
    assert [r["name"] for r in rows][:3] == ["f16", "bf16", "q8_0"]
    for r in rows:
        assert set(r) == {"name", "bits_per_value", "rel_mse_gaussian", "cosine_gaussian"}
    by = {r["name"]: r for r in rows}
    assert by["turbo3"]["bits_per_value"] == 3.25  # G = head_dim = 64
    assert by["turbo2"]["rel_mse_gaussian"] > by["turbo3"]["rel_mse_gaussian"] > by["turbo4"]["rel_mse_gaussian"]


@pytest.mark.model
def test_innerq_lowers_turbo_key_error_on_real_keys():
    from polykv.bench.codecs import real_kv_table
    from polykv.data import corpus_text
    from polykv.hf.loading import load_model

    model, tok = load_model()
    text = corpus_text()
    res = real_kv_table(model, tok, text[200000:204000], text[:4000], max_tokens=384)
    by = {r["name"]: r for r in res["rows"]}
    assert res["innerq_layers"], "SmolLM2 keys are unbalanced: InnerQ should apply to some layers"
    for name in ("turbo3", "turbo4"):
        assert by[name]["rel_mse_k_innerq"] < 0.9 * by[name]["rel_mse_k"], by[name]

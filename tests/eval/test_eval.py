"""Quality harness contracts on a tiny random Llama (SmolLM2's tokenizer, no real weights)."""

from __future__ import annotations

import json

import pytest
import torch

from polykv.eval.common import load_prompts

PPL_FIELDS = {"ppl", "ppl_ref", "delta_pct", "tokens"}
EQUIV_FIELDS = {"real_frac", "mean_tv", "p95_tv", "recall_mismatch", "n", "verdict"}
RULER_FIELDS = {"score", "score_ref", "samples"}
TIER_FIELDS = {"k", "v", "bits_per_value", "kv_bytes", "ppl_delta_pct", "mean_tv", "p95_tv",
               "real_frac", "recall_mismatch"}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from polykv.hf.loading import REGISTRY, _ensure_registry_cache

    return AutoTokenizer.from_pretrained(_ensure_registry_cache(REGISTRY["smollm2-135m"]))


@pytest.fixture(scope="module")
def tiny(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(cfg).eval()


def test_ppl_contract(tiny, tok):
    from polykv.eval.ppl import eval_ppl

    r = eval_ppl(tiny, tok, "q8_0", "turbo3", ctx=256, windows=2, progress=False)
    assert PPL_FIELDS <= set(r)
    assert r["tokens"] == 2 * 128
    assert r["delta_pct"] == pytest.approx((r["ppl"] / r["ppl_ref"] - 1) * 100)
    json.dumps(r)
    f16 = eval_ppl(tiny, tok, "f16", "f16", ctx=256, windows=2, progress=False)
    assert f16["delta_pct"] == 0.0 and f16["ppl"] == pytest.approx(r["ppl_ref"])


def test_ppl_scores_like_a_full_forward(tiny, tok):
    """Chunked scoring through f16 KV = one dense forward over the window (second half scored)."""
    import math

    from polykv.eval.common import load_text, make_cache
    from polykv.eval.ppl import corpus_windows, score_window

    ids = corpus_windows(tok, load_text(None), 200, 1)[0]
    nll, n = score_window(tiny, make_cache(tiny, "f16", "f16"), ids)
    tiny.set_attn_implementation("sdpa")
    with torch.inference_mode():
        lg = tiny(input_ids=torch.tensor([ids])).logits[0].float()
    x = torch.tensor(ids)
    ref = -torch.log_softmax(lg[99:199], -1).gather(1, x[100:200, None]).sum()
    assert n == 100
    assert math.isclose(nll, float(ref), rel_tol=1e-3)


def test_ppl_text_too_short(tiny, tok, tmp_path):
    from polykv.eval.ppl import eval_ppl

    p = tmp_path / "short.txt"
    p.write_text("Just a few words.")
    with pytest.raises(ValueError, match="fewer than one window"):
        eval_ppl(tiny, tok, "q8_0", "turbo3", ctx=256, text=p, progress=False)


def test_equiv_contract(tiny, tok):
    from polykv.eval.equiv import eval_equiv

    prompts = load_prompts(None)[:2]
    r = eval_equiv(tiny, tok, "turbo2", "turbo2", prompts=prompts, max_new_tokens=4, progress=False)
    assert EQUIV_FIELDS <= set(r)
    assert r["n"] == 2 and r["verdict"] in ("PASS", "FAIL")
    same = eval_equiv(tiny, tok, "f16", "f16", prompts=prompts, max_new_tokens=4, progress=False)
    assert same["mean_tv"] == 0.0 and same["real_frac"] == 0.0 and same["verdict"] == "PASS"


def test_equiv_prompt_file_errors(tmp_path):
    from polykv.eval.equiv import FORMAT_HELP

    p = tmp_path / "p.jsonl"
    p.write_text('{"context": "c", "question": "q"}\n')
    with pytest.raises(ValueError, match="context, question, needle"):
        load_prompts(p)
    p.write_text("not json\n")
    with pytest.raises(ValueError, match="p.jsonl:1"):
        load_prompts(p)
    assert "JSON Lines" in FORMAT_HELP and "needle" in FORMAT_HELP


@pytest.mark.parametrize("task", ["niah", "vt"])
def test_ruler_contract_and_seeding(tiny, tok, task):
    from polykv.eval.ruler import eval_ruler, make_samples

    r = eval_ruler(tiny, tok, task, 300, "q8_0", "turbo3", samples=2, seed=3, progress=False,
                   max_new_tokens=3)
    assert RULER_FIELDS <= set(r) and r["samples"] == 2
    a = make_samples(tok, task, 300, 3, seed=5)
    b = make_samples(tok, task, 300, 3, seed=5)
    assert a == b and a != make_samples(tok, task, 300, 3, seed=6)
    if task == "niah":
        assert [s["depth"] for s in a] == [0.0, 0.5, 1.0]
        assert all(s["answers"][0] in s["context"] and len(s["answers"][0]) == 7 for s in a)
    else:
        assert all(f"VAR {s['answers'][1]} = {s['answers'][0]}." in s["context"] for s in a)
    with pytest.raises(ValueError, match="valid tasks"):
        make_samples(tok, "qa", 300, 1, 0)


def test_tiers_contract(tiny, tok):
    from polykv.eval.tiers import eval_tiers, to_markdown

    presets = [("f16", "f16", False), ("q8_0", "turbo3", False), ("turbo3", "turbo3", True)]
    r = eval_tiers(tiny, tok, ctx=256, windows=1, prompts=load_prompts(None)[:1], presets=presets,
                   max_new_tokens=3, progress=False)
    assert len(r["rows"]) == 3
    for row in r["rows"]:
        assert TIER_FIELDS <= set(row)
    f16, q8t3, _ = r["rows"]
    assert f16["bits_per_value"] == 16.0 and q8t3["bits_per_value"] == pytest.approx((8.5 + 3.5) / 2)
    assert f16["kv_bytes"] / q8t3["kv_bytes"] > 2.6
    md = to_markdown(r)
    assert md.count("\n") == 4 and "turbo3 +InnerQ" in md
    json.dumps(r)


def test_cli_json(tiny, tok, tmp_path):
    from typer.testing import CliRunner

    from polykv.eval.cli import app

    d = tmp_path / "tiny"
    tiny.save_pretrained(d)
    tok.save_pretrained(d)
    runner = CliRunner()
    res = runner.invoke(app, ["ppl", "--k", "q8_0", "--v", "turbo3", "--ctx", "128", "--windows", "1",
                              "--model", str(d), "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout.strip().splitlines()[-1])
    assert PPL_FIELDS <= set(obj)
    res = runner.invoke(app, ["ppl", "--k", "q5_k", "--model", str(d), "--json"])
    assert res.exit_code != 0 and "valid types" in res.output
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and "JSON Lines" in res.output

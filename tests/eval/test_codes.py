"""The random-code needle set (polykv/data/make_codes.py) and `polykv eval ruler --task codes`."""

from __future__ import annotations

import collections
import json

import pytest
from typer.testing import CliRunner

from polykv.data.make_codes import CTXS, KINDS, PER_CTX, dumps, make
from polykv.eval.common import data_path
from polykv.eval.ruler import code_found, eval_ruler, make_samples


def test_bundled_file_is_the_generator_output():
    """code_prompts.jsonl = make(seed 0), byte for byte; another seed gives other codes."""
    rows = make(0)
    assert data_path("code_prompts.jsonl").read_text(encoding="utf-8") == dumps(rows)
    other = make(1)
    assert [r["needle"] for r in other] != [r["needle"] for r in rows]


def test_set_shape():
    """>= 48 prompts: 16 per length, each kind twice per length, depths 0..1, both genres, the code
    exactly once in its context, the question unambiguous (its label appears once)."""
    rows = make(0)
    assert len(rows) == len(CTXS) * PER_CTX >= 48 and len(CTXS) >= 3 and max(CTXS) == 4096
    per = collections.Counter((r["ctx"], r["kind"]) for r in rows)
    assert set(per.values()) == {2} and len(per) == len(CTXS) * len(KINDS)
    for c in CTXS:
        depths = sorted(r["depth"] for r in rows if r["ctx"] == c)
        assert depths[0] == 0.0 and depths[-1] == 1.0 and len(set(depths)) >= PER_CTX - 2
        assert {r["genre"] for r in rows if r["ctx"] == c} == {"tech", "novel"}
    for r in rows:
        assert r["context"].count(r["needle"]) == 1, r["id"]
        assert code_found(r["needle"], r["context"]), r["id"]
        label = r["question"].removeprefix("What is ").split("?")[0]
        assert r["context"].count(label) == 1 and r["prefix"].lower() == f"{label} is".lower()
    assert len({r["needle"] for r in rows}) == len(rows)


def test_prompt_lengths(tok):
    """With SmolLM2's chat template every prompt fits its nominal length and fills at least 70 %."""
    from polykv.eval.common import format_prompt

    for it in make_samples(tok, "codes", None, None, 0):
        n = len(format_prompt(tok, it["context"], it["question"], it["prefix"]))
        assert 0.7 * it["ctx"] <= n <= it["ctx"], (it["id"], n)


@pytest.mark.parametrize("code,answer,found", [
    ("47827635", " 47827635.", True),
    ("47827635", "The number is 47827635", True),
    ("47827635", "478276351", False),          # a longer number
    ("47827635", "147827635", False),
    ("47827635", "4782 7635", False),
    ("68-90-77-18", " 68-90-77-18.", True),
    ("68-90-77-18", "68-90-77-18-04", False),   # another group appended
    ("68-90-77-18", "68-90-77-1", False),
    ("meadow-22-tulip-zephyr", "meadow-22-tulip-zephyr.", True),
    ("meadow-22-tulip-zephyr", "Meadow-22-tulip-zephyr", False),  # exact: case counts
    ("9ZMJLsCfMZ", "`9ZMJLsCfMZ`", True),
    ("9ZMJLsCfMZ", "9ZMJLsCfMZa", False),
    ("10.140.230.127:44293", "at 10.140.230.127:44293.", True),
    ("10.140.230.127:44293", "10.140.230.127:442930", False),
])
def test_code_found(code, answer, found):
    assert code_found(code, answer) is found


def test_codes_select_and_errors():
    one = make_samples(None, "codes", 2048, 3, 0)
    assert [it["id"] for it in one] == ["2048-00-number", "2048-01-combination", "2048-02-password"]
    assert len(make_samples(None, "codes", None, None, 0)) == 48
    assert len(make_samples(None, "codes", None, 2, 0)) == 6
    with pytest.raises(ValueError, match="1024, 2048, 4096"):
        make_samples(None, "codes", 3000, None, 0)
    with pytest.raises(ValueError, match="does not apply"):
        make_samples(None, "codes", None, None, 0, text="x.txt")


def test_codes_scoring(tiny, tok, monkeypatch):
    """The score counts exact codes: a model that answers the code scores 100 %, one that answers it
    with a digit changed or appended scores 0; breakdowns by length and kind add up."""
    import polykv.eval.ruler as ruler

    items = make_samples(tok, "codes", None, 1, 0)
    answer = {}

    def fake_decode(model, cache, first, max_new, stop, **kw):
        it = items[len(answer) % len(items)]
        answer[len(answer)] = it
        return tok(f" {mutate(it['answers'][0])}.", add_special_tokens=False)["input_ids"], None

    monkeypatch.setattr(ruler, "decode_steps", fake_decode)
    for mutate, want in ((lambda c: c, 100.0), (lambda c: c[:-1] + ("0" if c[-1] != "0" else "1"), 0.0),
                         (lambda c: c + "7", 0.0)):
        answer.clear()
        r = eval_ruler(tiny, tok, "codes", None, "q8_0", "turbo3", samples=1, progress=False, details=True)
        assert (r["score"], r["score_ref"], r["samples"]) == (want, want, 3)
        assert sorted(r["by_ctx"]) == ["1024", "2048", "4096"] and r["ctx"] == [1024, 2048, 4096]
        assert sum(d["n"] for d in r["by_kind"].values()) == 3
        assert all(d["score"] == want for d in r["by_ctx"].values())
        json.dumps(r)


def test_codes_reference_reuse(tiny, tok):
    """--reference: the f16 run's items become score_ref; a reference of other samples is refused."""
    ref = eval_ruler(tiny, tok, "codes", 1024, "f16", "f16", samples=2, progress=False, details=True,
                     max_new_tokens=2)
    ref["items"][0]["ok"] = True  # a marker the recomputed reference would not have
    r = eval_ruler(tiny, tok, "codes", 1024, "q8_0", "turbo3", samples=2, progress=False,
                   max_new_tokens=2, reference=ref)
    assert r["score_ref"] == 100.0 * sum(i["ok"] for i in ref["items"]) / 2 >= 50.0
    with pytest.raises(ValueError, match="reference"):
        eval_ruler(tiny, tok, "codes", 1024, "q8_0", "turbo3", samples=1, progress=False, reference=ref)


def test_cli_codes(tiny_dir, tmp_path):
    from polykv.eval.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["ruler", "--task", "codes", "--ctx", "1024", "--samples", "1", "--k", "f16",
                              "--v", "f16", "--model", tiny_dir, "--details", "--json"])
    assert res.exit_code == 0, res.output
    ref = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"score", "score_ref", "samples", "by_ctx", "by_kind", "items"} <= set(ref) and ref["samples"] == 1
    p = tmp_path / "f16.json"
    p.write_text(json.dumps(ref))
    res = runner.invoke(app, ["ruler", "--task", "codes", "--ctx", "1024", "--samples", "1", "--preset", "default",
                              "--reference", str(p), "--model", tiny_dir, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["score_ref"] == ref["score"]
    res = runner.invoke(app, ["ruler", "--task", "codes", "--ctx", "512", "--model", tiny_dir, "--json"])
    assert res.exit_code != 0 and "1024, 2048, 4096" in res.output
    res = runner.invoke(app, ["ruler", "--task", "qa", "--model", tiny_dir, "--json"])
    assert res.exit_code != 0 and "codes" in res.output


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_f16_recalls_codes():
    """SmolLM2 with f16 KV recalls the first code of every kind at 1024 tokens (the set is answerable)."""
    from polykv.hf.loading import load_model

    m, tok = load_model(None)
    r = eval_ruler(m, tok, "codes", 1024, "f16", "f16", samples=8, progress=False, details=True)
    assert r["score"] >= 75.0, r["items"]

"""Quality harness contracts on a tiny random Llama (SmolLM2's tokenizer, no real weights)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from polykv.eval.common import format_prompt, load_prompts

from ..hf.test_kv_cache import FakeQuantCache

PPL_FIELDS = {"ppl", "ppl_ref", "delta_pct", "tokens"}
EQUIV_FIELDS = {"real_frac", "mean_tv", "p95_tv", "recall_mismatch", "n", "verdict"}
RULER_FIELDS = {"score", "score_ref", "samples"}
TIER_FIELDS = {"k", "v", "bits_per_value", "kv_bytes", "ppl_delta_pct", "mean_tv", "p95_tv",
               "real_frac", "recall_mismatch"}


# --- independent references (DESIGN §7 written out again, KV through tests/hf's FakeQuantCache) ----

def window_logits(model, cache, ids: list[int]) -> torch.Tensor:
    """float64 logits of positions 0..n-2 of a window fed as DESIGN §7 says: the first half in one
    forward, then chunks of 64 (the last token is scored, never fed)."""
    n, half = len(ids), len(ids) // 2
    bounds = [0, half] + list(range(half + 64, n - 1, 64)) + [n - 1]
    x = torch.tensor([ids])
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        return torch.cat([model(input_ids=x[:, a:b], past_key_values=cache).logits[0].double()
                          for a, b in zip(bounds, bounds[1:])], 0)


def reference_ppl(model, tok, k: str, v: str, ctx: int, windows: int) -> tuple[float, int]:
    """(perplexity, scored tokens): windows of ctx tokens cut from the bundled corpus (BOS first when
    the tokenizer adds one), second halves scored."""
    from polykv.eval.common import load_text

    ids = tok(load_text(None), add_special_tokens=False)["input_ids"]
    assert tok("a")["input_ids"][0] != tok.bos_token_id  # SmolLM2 adds no BOS: windows are plain slices
    nll, count = 0.0, 0
    for w in range(windows):
        win = ids[w * ctx:(w + 1) * ctx]
        lg = window_logits(model, FakeQuantCache(model, k, v), win)
        half = ctx // 2
        lp = torch.log_softmax(lg[half - 1:], -1)
        nll -= float(lp.gather(1, torch.tensor(win[half:])[:, None]).sum())
        count += ctx - half
    return math.exp(nll / count), count


@torch.inference_mode()
def reference_tv(model, tok, prompts, k: str, v: str, max_new: int) -> torch.Tensor:
    """TV at every answer position: greedy f16 answer (stops at EOS or max_new), teacher-forced
    through K/V stored as k/v, token by token (DESIGN §7)."""
    stop = {tok.eos_token_id}
    model.set_attn_implementation("sdpa")
    tvs = []
    for r in prompts:
        x = torch.tensor([format_prompt(tok, r["context"], r["question"])])
        ref, test = FakeQuantCache(model, "f16", "f16"), FakeQuantCache(model, k, v)
        lp = model(input_ids=x, past_key_values=ref).logits[0, -1].float()
        lq = model(input_ids=x, past_key_values=test).logits[0, -1].float()
        for t in range(max_new):
            p, q = torch.softmax(lp, -1), torch.softmax(lq, -1)
            tvs.append(0.5 * float((p - q).abs().sum()))
            nxt = int(lp.argmax())
            if nxt in stop or t == max_new - 1:
                break
            step = torch.tensor([[nxt]])
            lp = model(input_ids=step, past_key_values=ref).logits[0, -1].float()
            lq = model(input_ids=step, past_key_values=test).logits[0, -1].float()
    return torch.tensor(tvs, dtype=torch.float64)


def test_ppl_contract(tiny, tok):
    """ppl and ppl_ref equal the DESIGN §7 procedure computed independently (FakeQuantCache), for a
    compressed pair and for f16 itself; delta_pct follows from them."""
    from polykv.eval.ppl import eval_ppl

    r = eval_ppl(tiny, tok, "turbo2", "turbo2", ctx=256, windows=2, progress=False)
    assert PPL_FIELDS <= set(r)
    json.dumps(r)
    ppl_ref, n = reference_ppl(tiny, tok, "f16", "f16", 256, 2)
    ppl, _ = reference_ppl(tiny, tok, "turbo2", "turbo2", 256, 2)
    assert r["tokens"] == n == 2 * 128
    assert r["ppl_ref"] == pytest.approx(ppl_ref, rel=1e-6)
    assert r["ppl"] == pytest.approx(ppl, rel=1e-5)  # rotated-domain attention: float rounding
    assert r["delta_pct"] == pytest.approx((ppl / ppl_ref - 1) * 100, abs=2e-3)
    assert abs(ppl / ppl_ref - 1) > 1e-4  # turbo2 really changes the scores (measured ~+0.3%)
    f16 = eval_ppl(tiny, tok, "f16", "f16", ctx=256, windows=2, progress=False)
    assert f16["ppl"] == pytest.approx(ppl_ref, rel=1e-6) and f16["tokens"] == n


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
    """mean_tv / p95_tv / positions equal TV computed independently (greedy f16 answer teacher-forced
    through FakeQuantCache); the verdict is the DESIGN §7 rule applied to the reported metrics."""
    from polykv.eval.equiv import eval_equiv

    prompts = load_prompts(None)[:2]
    r = eval_equiv(tiny, tok, "turbo2", "turbo2", prompts=prompts, max_new_tokens=4, progress=False)
    assert EQUIV_FIELDS <= set(r)
    json.dumps(r)
    tv = reference_tv(tiny, tok, prompts, "turbo2", "turbo2", 4)
    assert r["n"] == 2 and r["positions"] == tv.numel() == 8
    assert r["mean_tv"] == pytest.approx(float(tv.mean()), rel=1e-3, abs=1e-7)
    assert r["p95_tv"] == pytest.approx(float(torch.quantile(tv, 0.95)), rel=1e-3, abs=1e-7)
    assert r["mean_tv"] > 1e-5  # turbo2 really moves the distributions
    want = "PASS" if r["real_frac"] <= 0.15 and r["recall_mismatch"] == 0 and r["p95_tv"] < 0.30 else "FAIL"
    assert r["verdict"] == want


def test_equiv_detects_divergence(tiny, tok):
    """A reference whose every step is sure of a token the cache under test never picks: TV ~1 at
    every position, a real divergence in every prompt, verdict FAIL."""
    from polykv.eval.equiv import eval_equiv, reference_runs

    prompts = load_prompts(None)[:2]
    refs = reference_runs(tiny, tok, prompts, max_new_tokens=3, progress=False)
    bad = []
    for ref in refs:
        p = torch.zeros_like(ref["probs"])
        wrong = (ref["probs"].argmax(-1) + 1) % p.shape[-1]  # a token other than the f16 top-1
        p[torch.arange(len(wrong)), wrong] = 1.0
        bad.append(dict(ref, probs=p))
    r = eval_equiv(tiny, tok, "f16", "f16", refs=bad, max_new_tokens=3, progress=False)
    assert r["real_frac"] == 1.0 and r["verdict"] == "FAIL"
    assert r["mean_tv"] > 0.99 and r["p95_tv"] > 0.99
    good = eval_equiv(tiny, tok, "f16", "f16", refs=refs, max_new_tokens=3, progress=False)
    assert good["mean_tv"] < 1e-6 and good["real_frac"] == 0.0 and good["verdict"] == "PASS"


@pytest.mark.parametrize("real_frac,mismatch,p95,verdict", [
    (0.15, 0, 0.2999, "PASS"), (0.0, 0, 0.0, "PASS"), (0.1501, 0, 0.1, "FAIL"), (0.0, 1, 0.1, "FAIL"),
    (0.0, 0, 0.30, "FAIL"), (1.0, 3, 0.9, "FAIL")])
def test_verdict_thresholds(real_frac, mismatch, p95, verdict):
    from polykv.eval.equiv import verdict_of

    assert verdict_of(real_frac, mismatch, p95) == verdict


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
    assert r["score"] in (0.0, 50.0, 100.0) and r["score_ref"] in (0.0, 50.0, 100.0)  # % of 2 samples
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
    with pytest.raises(ValueError, match="ctx must be >= "):  # no room for filler: not the ctx asked for
        make_samples(tok, task, 16, 1, 0)


def test_tiers_contract(tiny, tok):
    from polykv.eval.tiers import eval_tiers, to_markdown

    from polykv.codecs import InnerQTable
    from polykv.eval.equiv import eval_equiv
    from polykv.eval.ppl import eval_ppl

    presets = [("f16", "f16", False), ("q8_0", "turbo3", False), ("turbo3", "turbo3", True)]
    table = InnerQTable(scales={i: torch.linspace(0.5, 2.0, 32)[None] for i in range(2)})
    prompts = load_prompts(None)[:1]
    r = eval_tiers(tiny, tok, ctx=256, windows=1, prompts=prompts, presets=presets, innerq=table,
                   max_new_tokens=3, progress=False)
    assert len(r["rows"]) == 3
    for row in r["rows"]:
        assert TIER_FIELDS <= set(row)
    f16, q8t3, t3iq = r["rows"]
    assert f16["bits_per_value"] == 16.0 and q8t3["bits_per_value"] == pytest.approx((8.5 + 3.5) / 2)
    # 2 layers x 1 KV head x 255 stored rows (the last scored token is never fed), bytes per row of
    # K + V from DESIGN §3 at head_dim 32 (turbo group 32)
    assert f16["kv_bytes"] == 2 * 255 * (64 + 64)
    assert q8t3["kv_bytes"] == 2 * 255 * (34 + 14)
    # each row is its preset run on its own; the f16 row is the reference, delta 0 by definition
    ppl_ref, _ = reference_ppl(tiny, tok, "f16", "f16", 256, 1)
    assert r["ppl_ref"] == f16["ppl"] == pytest.approx(ppl_ref, rel=1e-6) and f16["ppl_delta_pct"] == 0.0
    for row, iq in ((q8t3, None), (t3iq, table)):
        alone = eval_ppl(tiny, tok, row["k"], row["v"], ctx=256, windows=1, innerq=iq, progress=False)
        assert row["ppl"] == pytest.approx(alone["ppl"], rel=1e-9)
        assert row["ppl_delta_pct"] == pytest.approx(alone["delta_pct"], abs=1e-9)
        e = eval_equiv(tiny, tok, row["k"], row["v"], prompts=prompts, innerq=iq, max_new_tokens=3,
                       progress=False)
        assert (row["mean_tv"], row["p95_tv"], row["verdict"]) == (e["mean_tv"], e["p95_tv"], e["verdict"])
    assert t3iq["ppl"] != eval_ppl(tiny, tok, "turbo3", "turbo3", ctx=256, windows=1, progress=False)["ppl"]
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


def test_prefill_score_f16_is_a_dense_forward(tiny, tok):
    """prefill-score with f16 KV = one dense forward over the text, the last 30 % of tokens scored."""
    from polykv.eval.ppl import corpus_windows, eval_prefill_score

    n = 300
    ids = corpus_windows(tok, load_prompts(None)[0]["context"] * 3, n, 1)[0]
    text = tok.decode(ids)
    r = eval_prefill_score(tiny, tok, "f16", "f16", ctx=n, text=text, progress=False)
    ids = corpus_windows(tok, text, n, 1)[0]
    split = round(0.7 * n)
    tiny.set_attn_implementation("sdpa")
    with torch.inference_mode():
        lg = tiny(input_ids=torch.tensor([ids])).logits[0].double()
    nll = -torch.log_softmax(lg[split - 1:n - 1], -1).gather(1, torch.tensor(ids[split:])[:, None]).sum()
    assert PPL_FIELDS <= set(r) and r["tokens"] == n - split == 90 and r["prefix_tokens"] == split
    assert r["ppl_ref"] == pytest.approx(math.exp(float(nll) / (n - split)), rel=1e-5)
    assert r["ppl"] == r["ppl_ref"] and r["delta_pct"] == 0.0
    # f16: 2 layers x 1 KV head x 210 prefix rows x (K + V) x head_dim 32 x 2 bytes, measured
    assert r["kv_bytes_f16"] == r["kv_bytes"] == 2 * 210 * 2 * 32 * 2 and r["kv_bytes_held"] >= r["kv_bytes"]


def test_prefill_score_compressed_matches_reference(tiny, tok):
    """A compressed pair: the same as FakeQuantCache fed the prefix in one forward, then the rest in one
    forward (DESIGN-independent reference); bytes measured on the compressed prefix."""
    from polykv.eval.ppl import corpus_windows, eval_prefill_score

    n = 256
    r = eval_prefill_score(tiny, tok, "turbo2", "turbo2", ctx=n, progress=False)
    ids = corpus_windows(tok, load_text_default(), n, 1)[0]
    split = round(0.7 * n)
    tiny.set_attn_implementation("sdpa")
    x = torch.tensor([ids])
    with torch.inference_mode():
        cache = FakeQuantCache(tiny, "turbo2", "turbo2")
        lg = torch.cat([tiny(input_ids=x[:, :split], past_key_values=cache).logits[0, -1:].double(),
                        tiny(input_ids=x[:, split:n - 1], past_key_values=cache).logits[0].double()], 0)
    nll = -torch.log_softmax(lg, -1).gather(1, x[0, split:, None]).sum()
    assert r["ppl"] == pytest.approx(math.exp(float(nll) / (n - split)), rel=1e-5)
    assert abs(r["delta_pct"]) > 1e-3  # turbo2 really changes the scores
    # 2 layers x split rows; bytes per row of K + V from DESIGN §3 at head_dim 32: turbo2 10 + 10, f16 64 + 64
    assert r["kv_bytes"] == 2 * split * (10 + 10) and r["kv_bytes_f16"] == 2 * split * 128
    assert r["bytes_ratio"] == pytest.approx(128 / 20) and r["bytes_ratio_held"] <= r["bytes_ratio"]


def test_cli_prefill_score(tiny_dir):
    from typer.testing import CliRunner

    from polykv.eval.cli import app

    res = CliRunner().invoke(app, ["ppl", "--method", "prefill-score", "--ctx", "200", "--model", tiny_dir, "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["method"] == "prefill-score" and r["tokens"] == 60 and r["windows"] == 1
    assert {"kv_bytes_held", "kv_bytes_f16", "bytes_ratio_held", "bytes_ratio"} <= set(r)
    res = CliRunner().invoke(app, ["ppl", "--method", "sliding", "--model", tiny_dir, "--json"])
    assert res.exit_code != 0 and "prefill-score" in res.output


def load_text_default():
    from polykv.eval.common import load_text

    return load_text(None)


def test_ppl_chunk_feeds_the_scored_half_token_by_token(tiny, tok, tiny_dir, monkeypatch):
    """eval_ppl(chunk=1) scores the same tokens fed one per forward (f16: the same perplexity as
    chunks of 64, to float rounding; compressed: its own figure); the CLI passes --chunk and
    --skip-tokens through and reports chunk only when it is not the default."""
    import json

    from typer.testing import CliRunner

    from polykv.eval import ppl as P
    from polykv.eval.cli import app

    fed = []
    orig = P.score_window
    monkeypatch.setattr(P, "score_window", lambda m, c, ids, chunk=P.CHUNK: fed.append(chunk) or orig(m, c, ids, chunk))
    one = P.eval_ppl(tiny, tok, "q8_0", "turbo3", ctx=96, windows=1, progress=False, chunk=1)
    base = P.eval_ppl(tiny, tok, "q8_0", "turbo3", ctx=96, windows=1, progress=False)
    assert fed == [1, 1, 64, 64]  # cache under test, then its f16 reference, per call
    assert one["chunk"] == 1 and "chunk" not in base and one["tokens"] == base["tokens"]
    assert one["ppl_ref"] == pytest.approx(base["ppl_ref"], rel=1e-4)
    res = CliRunner().invoke(app, ["ppl", "--k", "q8_0", "--v", "turbo3", "--ctx", "96", "--windows", "1",
                                   "--chunk", "8", "--skip-tokens", "96", "--model", tiny_dir, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["chunk"] == 8 and fed[-2:] == [8, 8]
    res = CliRunner().invoke(app, ["ppl", "--method", "prefill-score", "--chunk", "8", "--model", tiny_dir])
    assert res.exit_code != 0 and "windows only" in res.output

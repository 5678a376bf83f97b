"""Simulated anchors (polykv/eval/anchors.py) on the tiny random Llama: no anchors = the plain cache,
every row anchored exactly = f16 (so the rows land in the domain attention reads: rotated, InnerQ),
the positions table, the bits, the CLI field."""

from __future__ import annotations

import pytest
import torch

from polykv.codecs import InnerQTable, get_codec
from polykv.eval.anchors import AnchoredKVCache, Anchors, anchor_rows, anchored_bits
from polykv.eval.ppl import eval_ppl
from tests.eval.conftest import ppl_cli


@pytest.mark.parametrize("start, rows, sink, recent, want", [
    (0, 10, 0, 0, []),
    (0, 10, 3, 0, [0, 1, 2]),
    (0, 10, 0, 2, [8, 9]),
    (0, 10, 3, 2, [0, 1, 2, 8, 9]),
    (5, 4, 3, 0, []),  # a sliding layer whose stored rows start after the sinks
    (5, 4, 7, 1, [0, 1, 3]),  # positions 5, 6 are sinks, 8 is recent
    (0, 3, 2, 5, [0, 1, 2]),  # overlapping sink / recent, each row once
    (0, 0, 4, 4, []),
])
def test_anchor_rows(start, rows, sink, recent, want):
    assert anchor_rows(start, rows, sink, recent).tolist() == want


def test_parse():
    assert Anchors.parse("recent=32") == Anchors(recent=32)
    assert Anchors.parse("sink=4, recent=8,anchor=exact") == Anchors(4, 8, "exact")
    for bad in ("recent", "window=3", "recent=-1", "anchor=q5_k"):
        with pytest.raises(ValueError):
            Anchors.parse(bad)


def _innerq(tiny) -> InnerQTable:
    g = torch.Generator().manual_seed(1)
    kv, hd = tiny.config.num_key_value_heads, tiny.config.head_dim
    return InnerQTable({i: 0.5 + 1.5 * torch.rand(kv, hd, generator=g)
                        for i in range(tiny.config.num_hidden_layers)})


def test_no_anchors_is_the_plain_cache(tiny, tok):
    plain = eval_ppl(tiny, tok, "q8_0", "turbo3", ctx=256, windows=1, progress=False)
    none = eval_ppl(tiny, tok, "q8_0", "turbo3", ctx=256, windows=1, progress=False,
                    ppl_ref=plain["ppl_ref"], anchors=Anchors(0, 0, "exact"))
    assert none["ppl"] == plain["ppl"]
    assert none["anchors"]["bits_per_value_anchored"] == none["anchors"]["bits_per_value_stored"]
    assert "anchors" not in plain


@pytest.mark.parametrize("spec", [Anchors(sink=10**6, anchor="exact"), Anchors(recent=10**6, anchor="exact")])
@pytest.mark.parametrize("k, v, innerq", [("turbo3", "turbo2", True), ("q8_0", "turbo2", False),
                                          ("turbo2", "q4_0", False)])
def test_every_row_anchored_exactly_is_f16(tiny, tok, spec, k, v, innerq):
    iq = _innerq(tiny) if innerq else None
    base = eval_ppl(tiny, tok, k, v, ctx=256, windows=1, progress=False, innerq=iq)
    r = eval_ppl(tiny, tok, k, v, ctx=256, windows=1, progress=False, innerq=iq, anchors=spec,
                 ppl_ref=base["ppl_ref"])
    assert abs(base["delta_pct"]) > 0.02  # the codecs do move this model's perplexity (0.03-0.1 %)
    assert r["delta_pct"] == pytest.approx(0.0, abs=0.001)  # f16 storage vs float32 rows: 1e-4 %
    assert r["anchors"]["bits_per_value_anchored"] == 16.0


def test_recent_window_is_between(tiny, tok):
    """Some rows anchored: closer to f16 than none, and only those rows' bits change."""
    base = eval_ppl(tiny, tok, "turbo2", "turbo2", ctx=256, windows=1, progress=False)
    r = eval_ppl(tiny, tok, "turbo2", "turbo2", ctx=256, windows=1, progress=False,
                 ppl_ref=base["ppl_ref"], anchors=Anchors(sink=2, recent=16))
    assert abs(r["delta_pct"]) < abs(base["delta_pct"])
    assert r["delta_pct"] != 0.0


def test_anchored_bits(tiny, tok):
    from polykv.eval.common import load_text
    from polykv.eval.ppl import corpus_windows, score_window

    ids = corpus_windows(tok, load_text(None), 200, 1)[0]
    hd = tiny.config.head_dim
    t2, q8 = get_codec("turbo2", hd).bits_per_value(), get_codec("q8_0", hd).bits_per_value()
    for spec, want in [(Anchors(), t2), (Anchors(sink=10**6), q8), (Anchors(sink=1, recent=9), None)]:
        cache = AnchoredKVCache(tiny, k="turbo2", v="turbo2", anchors=spec)
        score_window(tiny, cache, ids)
        b = anchored_bits(cache)
        assert b["bits_per_value_stored"] == pytest.approx(cache.memory_report()["bits_per_value"])
        rows = cache.get_seq_length()
        assert rows == 199
        expect = want if want is not None else t2 + (q8 - t2) * 10 / rows
        assert b["bits_per_value_anchored"] == pytest.approx(expect)


def test_cli_anchors(tiny_dir):
    res, obj = ppl_cli(tiny_dir, "--anchors", "recent=8,sink=2")
    assert res.exit_code == 0, res.output
    assert obj["anchors"]["recent"] == 8 and obj["anchors"]["anchor"] == "q8_0"
    assert obj["anchors"]["bits_per_value_anchored"] > obj["anchors"]["bits_per_value_stored"]
    res, _ = ppl_cli(tiny_dir, "--anchors", "window=3")
    assert res.exit_code != 0 and "anchors spec" in res.output


@pytest.mark.parametrize("spec", [Anchors(sink=10**6, anchor="exact"), Anchors(recent=10**6, anchor="exact")])
@pytest.mark.parametrize("k, v", [("turbo3", "turbo2"), ("q4_0", "turbo3"), ("turbo4", "q8_0")])
def test_logits_with_every_row_anchored_match_f16(tiny, tok, spec, k, v):
    """Logits of a chunk after a prefill (InnerQ on turbo K): every row anchored exactly = f16 KV to
    float rounding (measured 2e-5; a row mapped into the wrong domain — InnerQ scale left out — 2e-3),
    while the plain compressed cache is off by more (9e-4 to 5e-2)."""
    from polykv.hf.kv_cache import KVCache

    iq = _innerq(tiny)
    x = torch.randint(0, len(tok), (1, 160), generator=torch.Generator().manual_seed(2))

    def logits(cache):
        with torch.inference_mode():
            tiny(input_ids=x[:, :128], past_key_values=cache, use_cache=True)
            return tiny(input_ids=x[:, 128:], past_key_values=cache, use_cache=True).logits[0]

    ref = logits(KVCache(tiny, k="f16", v="f16"))
    plain = logits(KVCache(tiny, k=k, v=v, innerq=iq))
    anchored = logits(AnchoredKVCache(tiny, k=k, v=v, innerq=iq, anchors=spec))
    assert (plain - ref).abs().max() > 5e-4
    assert (anchored - ref).abs().max() < 2e-4


def test_equiv_and_ruler_take_anchors(tiny, tok, monkeypatch):
    """Decode steps (one query, the materialize path) read anchors too: no anchors = the plain figures,
    every row exact = f16 (TV at rounding level, the same greedy answers)."""
    from polykv.eval.common import load_prompts
    from polykv.eval.equiv import eval_equiv, reference_runs
    from polykv.eval.ruler import eval_ruler

    prompts = load_prompts(None)[:2]
    refs = reference_runs(tiny, tok, prompts, 4, progress=False)
    kw = dict(prompts=prompts, max_new_tokens=4, progress=False, refs=refs)
    plain = eval_equiv(tiny, tok, "turbo2", "turbo2", **kw)
    none = eval_equiv(tiny, tok, "turbo2", "turbo2", anchors=Anchors(), **kw)
    every = eval_equiv(tiny, tok, "turbo2", "turbo2", anchors=Anchors(recent=10**6, anchor="exact"), **kw)
    assert none["mean_tv"] == plain["mean_tv"] and none["anchors"] == Anchors().as_dict()
    assert plain["mean_tv"] > 1e-5 and every["mean_tv"] < plain["mean_tv"] / 20
    calls = []
    attend = AnchoredKVCache.attend
    monkeypatch.setattr(AnchoredKVCache, "attend", lambda self, *a, **kw: calls.append(1) or attend(self, *a, **kw))
    r = eval_ruler(tiny, tok, "niah", 300, "turbo2", "turbo2", samples=2, seed=3, progress=False,
                   max_new_tokens=3, details=True, anchors=Anchors(sink=10**6, anchor="exact"))
    assert r["anchors"]["sink"] == 10**6
    assert len(calls) >= 2 * 2 * 3  # samples x layers x (prefill + decode steps): the anchored cache ran
    assert [i["answer"] for i in r["items"]] == [i["answer_ref"] for i in r["items"]]


def test_f16_with_anchors_is_scored_against_the_plain_f16_reference(tiny, tok):
    """An f16/f16 run whose anchors store rows otherwise is not its own reference: its ppl_ref is the
    plain f16 run's (it was taken from the run itself, forcing delta_pct to 0)."""
    plain = eval_ppl(tiny, tok, "f16", "f16", ctx=256, windows=1, progress=False)
    r = eval_ppl(tiny, tok, "f16", "f16", ctx=256, windows=1, progress=False,
                 anchors=Anchors(sink=4, recent=8, anchor="turbo2"))
    assert r["ppl_ref"] == plain["ppl"] and r["ppl"] != plain["ppl"] and r["delta_pct"] != 0

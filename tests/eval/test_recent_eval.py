"""The recent window as storage through the quality harness (`recent=` / `--recent`): the same floats as
the simulation (`anchors=Anchors(recent=R)`), its bytes in kv_bytes, the f16 bytes beside them."""

from __future__ import annotations

import pytest

from polykv.eval.anchors import Anchors
from polykv.eval.ppl import eval_ppl
from tests.eval.conftest import ppl_cli


@pytest.mark.parametrize("k, v", [("turbo3", "turbo2"), ("q8_0", "turbo3")])
def test_ppl_with_a_ring_is_the_simulated_figure(tiny, tok, k, v):
    plain = eval_ppl(tiny, tok, k, v, ctx=256, windows=2, progress=False)
    ring = eval_ppl(tiny, tok, k, v, ctx=256, windows=2, progress=False, recent=16)
    sim = eval_ppl(tiny, tok, k, v, ctx=256, windows=2, progress=False, ppl_ref=plain["ppl_ref"],
                   anchors=Anchors(recent=16))
    assert ring["ppl"] == sim["ppl"] != plain["ppl"]
    assert ring["recent"] == 16 and "recent" not in plain
    cfg = tiny.config
    row = cfg.head_dim + 2 * (cfg.head_dim // 32)  # q8_0 bytes per row
    assert ring["kv_bytes"] - plain["kv_bytes"] == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 16 * row
    assert ring["kv_bytes_f16"] == plain["kv_bytes_f16"] > ring["kv_bytes"]
    assert ring["bytes_ratio"] == pytest.approx(ring["kv_bytes_f16"] / ring["kv_bytes"])


def test_equiv_decode_steps_read_the_ring(tiny, tok):
    """One-token decode steps (materialize path on CPU) with a ring = the simulation's TV."""
    from polykv.eval.common import load_prompts
    from polykv.eval.equiv import eval_equiv, reference_runs

    prompts = load_prompts(None)[:2]
    refs = reference_runs(tiny, tok, prompts, 4, progress=False)
    kw = dict(prompts=prompts, max_new_tokens=4, progress=False, refs=refs)
    plain = eval_equiv(tiny, tok, "turbo2", "turbo2", **kw)
    ring = eval_equiv(tiny, tok, "turbo2", "turbo2", recent=8, **kw)
    sim = eval_equiv(tiny, tok, "turbo2", "turbo2", anchors=Anchors(recent=8), **kw)
    assert ring["mean_tv"] == sim["mean_tv"] != plain["mean_tv"]
    assert ring["recent"] == 8


def test_cli_recent(tiny_dir):
    res, obj = ppl_cli(tiny_dir, "--recent", "8")
    assert res.exit_code == 0, res.output
    assert obj["recent"] == 8 and obj["bytes_ratio"] > 1
    res, _ = ppl_cli(tiny_dir, "--recent", "8", "--anchors", "recent=8")
    assert res.exit_code != 0 and "drop --recent" in res.output

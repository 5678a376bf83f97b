"""`--preset` on the eval commands: resolved as `polykv demo` / `serve` resolve it (--k / --v / --innerq
win), and the resolved types are the ones measured (not only printed)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner


def run_json(args: list[str]) -> dict:
    from polykv.eval.cli import app

    res = CliRunner().invoke(app, args + ["--json"])
    assert res.exit_code == 0, f"{res.output}\n{res.exception!r}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("preset,k,v,innerq,want", [
    (None, None, None, None, ("q8_0", "turbo3", None)),
    ("default", None, None, None, ("q8_0", "turbo3", None)),
    ("balanced", None, None, None, ("turbo4", "turbo3", "auto")),
    ("balanced", None, None, "none", ("turbo4", "turbo3", None)),
    ("max", None, "q8_0", None, ("turbo3", "q8_0", "auto")),
    ("max", "f16", "f16", None, ("f16", "f16", "auto")),
    (None, "turbo4", None, "/tmp/table.safetensors", ("turbo4", "turbo3", "/tmp/table.safetensors")),
])
def test_resolve_kv(preset, k, v, innerq, want):
    from polykv.eval.cli import resolve_kv

    assert resolve_kv(preset, k, v, innerq) == want


@pytest.mark.parametrize("preset,k,match", [("bogus", None, "unknown preset"), ("max", "q5_k", "valid types")])
def test_resolve_kv_errors(preset, k, match):
    from polykv.eval.cli import resolve_kv

    with pytest.raises(typer.BadParameter, match=match):
        resolve_kv(preset, k, None, None)


def test_ppl_preset_measures_the_preset_types(tiny, tok, tiny_dir):
    """--preset max runs K turbo3 / V turbo2 with its recent window (the same perplexity as eval_ppl
    with those types and R); --v overrides the preset's V."""
    from polykv.eval.ppl import eval_ppl
    from polykv.presets import PRESETS

    R = PRESETS["max"].recent
    r = run_json(["ppl", "--preset", "max", "--ctx", "128", "--windows", "1", "--model", tiny_dir])
    assert (r["k"], r["v"], r["preset"], r.get("recent", 0)) == ("turbo3", "turbo2", "max", R)
    direct = eval_ppl(tiny, tok, "turbo3", "turbo2", ctx=128, windows=1, progress=False, recent=R)
    assert r["ppl"] == pytest.approx(direct["ppl"], rel=1e-6)
    assert r["kv_bytes"] == direct["kv_bytes"]
    r = run_json(["ppl", "--preset", "max", "--v", "q8_0", "--ctx", "128", "--windows", "1", "--model", tiny_dir])
    assert (r["k"], r["v"]) == ("turbo3", "q8_0")
    r = run_json(["ppl", "--ctx", "128", "--windows", "1", "--model", tiny_dir])
    assert (r["k"], r["v"], r["preset"]) == ("q8_0", "turbo3", None)


def test_equiv_and_ruler_preset(tiny_dir):
    r = run_json(["equiv", "--preset", "max", "--limit", "1", "--max-new-tokens", "2", "--model", tiny_dir])
    assert (r["k"], r["v"], r["preset"]) == ("turbo3", "turbo2", "max") and r["n"] == 1
    r = run_json(["ruler", "--preset", "balanced", "--k", "q4_0", "--ctx", "200", "--samples", "1",
                  "--model", tiny_dir])
    assert (r["k"], r["v"], r["preset"]) == ("q4_0", "turbo3", "balanced") and r["samples"] == 1


def test_tiers_named_presets(tiny_dir):
    """tiers --preset default,max: an f16 reference row, then one row per named preset."""
    r = run_json(["tiers", "--preset", "default,max", "--ctx", "128", "--windows", "1", "--no-equiv",
                  "--model", tiny_dir])
    got = [(row["k"], row["v"], row["innerq"], row["preset"]) for row in r["rows"]]
    assert got == [("f16", "f16", False, None), ("q8_0", "turbo3", False, "default"),
                   ("turbo3", "turbo2", True, "max")]
    assert r["rows"][0]["ppl_delta_pct"] == 0.0 and r["rows"][2]["ppl_delta_pct"] != 0.0
    from polykv.eval.cli import app

    res = CliRunner().invoke(app, ["tiers", "--preset", "default,bogus", "--model", tiny_dir, "--json"])
    assert res.exit_code != 0 and "unknown preset" in res.output

"""`polykv calibrate --bits` through the real CLI at tiny size (a 2-layer random Llama with SmolLM2's
tokenizer, as in tests/test_cli_smoke.py), then `polykv eval ppl --preset` picking the table up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner


def run_json(args: list[str]) -> dict:
    from polykv.cli import app

    res = CliRunner().invoke(app, args + ["--json"])
    assert res.exit_code == 0, f"{res.output}\n{res.exception!r}"
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stdout[-2000:]
    return json.loads(lines[0])


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_calibrate_bits_then_preset(tiny_dir, cache_dir):
    from polykv.cli import app

    r = run_json(["calibrate", "--model", tiny_dir, "--bits", "3.6", "--scored-tokens", "64",
                  "--prefix-tokens", "256", "--per-layer", "--copy-weight", "0"])
    # the fields calibrate always had
    assert set(r) >= {"path", "model", "layers_scaled", "tokens"} and r["tokens"] == 2048
    assert Path(r["path"]).exists() and Path(r["path"]).parent == cache_dir / "innerq"
    # the policy's
    # head_dim 32: the cheapest pair (turbo3 / turbo2) is 3.0 bits/value, one upgrade costs 0.25
    assert r["bits_target"] == 3.6 and 3.0 < r["bits_achieved"] <= 3.6
    assert [row["layer"] for row in r["layer_types"]] == [0, 1]
    assert all(row["k"] in ("turbo3", "turbo4", "q8_0") and row["v"] in ("turbo2", "turbo3", "turbo4")
               for row in r["layer_types"])
    saved = json.loads(Path(r["precision_path"]).read_text())
    assert Path(r["precision_path"]).parent == cache_dir / "innerq"
    assert saved["policies"]["3.6"]["types"] == [[row["k"], row["v"]] for row in r["layer_types"]]
    assert saved["prefix"] == 256 and saved["tokens"] == 320

    # eval ppl --preset max finds it (and --precision none does not use it)
    for precision, source in (("auto", "calibrated"), ("none", "fixed")):
        e = run_json(["eval", "ppl", "--model", tiny_dir, "--preset", "max", "--ctx", "64", "--windows", "1",
                      "--precision", precision])
        assert e["precision"]["source"] == source, e["precision"]
        assert e["ppl"] > 0
    # tiers: the named preset's row says calibrated, its measured bits are the allocation's
    t = run_json(["eval", "tiers", "--model", tiny_dir, "--preset", "balanced", "--ctx", "64", "--windows", "1",
                  "--limit", "1", "--max-new-tokens", "2"])
    row = [r for r in t["rows"] if r["preset"] == "balanced"][0]
    assert row["precision"] == "calibrated" and row["verdict"] in ("PASS", "FAIL")
    from polykv.hf.precision import PrecisionTable
    from polykv.presets import PRESETS

    want = PrecisionTable.load(r["precision_path"]).allocate(PRESETS["balanced"].bits)
    assert set(want.types) != {("turbo4", "turbo3")}  # else the check below could not tell
    # + the preset's recent ring: min(R, rows) q8_0 rows (8.5 bits) per layer over the 63 rows stored
    R = PRESETS["balanced"].recent
    assert row["recent"] == R
    assert abs(row["bits_per_value"] - want.bits_achieved - min(R, 63) * 8.5 / 63) < 1e-9
    # a budget below the cheapest types is refused with a message
    res = CliRunner().invoke(app, ["calibrate", "--model", tiny_dir, "--bits", "1.0", "--scored-tokens", "8",
                                   "--prefix-tokens", "16", "--json"])
    assert res.exit_code != 0 and "below the cheapest" in res.output


def test_calibrate_per_head_then_preset(tiny_dir, cache_dir):
    """--per-head: the table has one row per (layer, KV head) and the policy's layer_types a "head";
    eval ppl --preset max takes that per-head allocation (precision: per_head, one pair per row)."""
    from polykv.hf.precision import PrecisionTable

    r = run_json(["calibrate", "--model", tiny_dir, "--bits", "3.3", "--scored-tokens", "32",
                  "--prefix-tokens", "128", "--copy-prompts", "2"])  # per head with the copying signal: the defaults
    t = PrecisionTable.load(r["precision_path"])
    heads = t.kv_heads
    assert heads is not None and t.layers == sum(heads) and len(heads) == 2
    assert [(row["layer"], row["head"]) for row in r["layer_types"]] == [
        (i, h) for i, n in enumerate(heads) for h in range(n)]
    assert t.policies["3.3"].kv_heads == heads
    assert r["copy_weight"] == 0.25 and t.meta["weights"] == {"novel": 0.75, "copy": 0.25}
    e = run_json(["eval", "ppl", "--model", tiny_dir, "--preset", "max", "--ctx", "64", "--windows", "1"])
    assert e["precision"]["source"] == "calibrated" and e["precision"]["per_head"] is True
    assert len(e["precision"]["types"]) == sum(heads) and e["ppl"] > 0


def test_calibrate_copy_signal_flags(tiny_dir, cache_dir):
    """--copy-weight / --copy-prompts reach the table: both signals and their weights are saved, the
    table's errors are their combination; --copy-weight 0 measures novel text only; out of range refused."""
    from polykv.cli import app
    from polykv.hf.precision import PrecisionTable, combine_errors

    r = run_json(["calibrate", "--model", tiny_dir, "--bits", "3.6", "--scored-tokens", "32",
                  "--prefix-tokens", "128", "--copy-prompts", "2", "--copy-weight", "0.75", "--per-layer"])
    assert r["copy_weight"] == 0.75 and r["copy_prompts"] == 2
    t = PrecisionTable.load(r["precision_path"])
    sig = t.meta["signals"]
    assert sig["copy"]["prompts"] == 2 and sig["copy"]["scored"] > 2 * 3  # ' code.' is several tokens
    assert t.meta["weights"] == {"novel": 0.25, "copy": 0.75}
    assert (t.k_error, t.v_error) == combine_errors(t.bits, sig, t.meta["weights"], t.k_types, t.v_types)
    assert t.policies["3.6"].types == t.reweigh(0.75).allocate(3.6).types

    r0 = run_json(["calibrate", "--model", tiny_dir, "--bits", "3.6", "--scored-tokens", "32",
                   "--prefix-tokens", "128", "--copy-weight", "0", "--per-layer"])
    t0 = PrecisionTable.load(r0["precision_path"])
    assert r0["copy_prompts"] == 0 and "signals" not in t0.meta
    assert t0.k_error == sig["novel"]["k_error"] and t0.v_error == sig["novel"]["v_error"]
    res = CliRunner().invoke(app, ["calibrate", "--model", tiny_dir, "--bits", "3.6", "--copy-weight", "2",
                                   "--scored-tokens", "8", "--prefix-tokens", "16", "--json"])
    assert res.exit_code != 0 and "--copy-weight" in res.output


def test_cli_copy_defaults_match_the_library():
    """calibrate's --copy-weight / --copy-prompts / --per-head defaults are hf.precision's constants (cli.py keeps
    literals so that `polykv --help` needs no torch)."""
    import inspect

    from polykv.cli import calibrate
    from polykv.hf.precision import COPY_PROMPTS, COPY_WEIGHT, PER_HEAD

    params = inspect.signature(calibrate).parameters
    assert params["copy_weight"].default.default == COPY_WEIGHT
    assert params["per_head"].default.default == PER_HEAD
    assert params["copy_prompts"].default.default == COPY_PROMPTS

"""Smoke tests of every `polykv` command of DESIGN §6 at tiny size, through the real CLI: with --json
stdout is exactly one JSON object carrying the contract fields (checked for type and sense).

Every command runs on a 2-layer random Llama saved as a local HF directory with SmolLM2's real
tokenizer (chat template included), so each takes seconds (the real SmolLM2 demo: tests/test_demo.py).
`bench fanout` / `bench e2e` are covered by tests/bench. GPU-only commands must fail on a CPU machine
with a message that says so. Not tested because not implemented yet: `bench spec`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
KV_TYPES = ("f16", "bf16", "q8_0", "q4_0", "turbo8", "turbo4", "turbo3", "turbo2")


def run_cli(args: list[str], ok: bool = True):
    """Invoke `polykv ARGS` in process; returns the Click result (stdout and stderr apart)."""
    from polykv.cli import app

    res = CliRunner().invoke(app, args)
    if ok:
        assert res.exit_code == 0, f"{res.output}\n{res.exception!r}"
    return res


def run_json(args: list[str]) -> dict:
    """The command's stdout must be exactly one JSON object (progress and logs go to stderr)."""
    res = run_cli(args + ["--json"])
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stdout[-2000:]
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama (head_dim 32, GQA 2:1) with SmolLM2's tokenizer, as a local HF dir."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from polykv.hf.loading import REGISTRY, _ensure_registry_cache

    tok = AutoTokenizer.from_pretrained(_ensure_registry_cache(REGISTRY["smollm2-135m"]))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    d = tmp_path_factory.mktemp("tiny") / "model"
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    rows = [{"context": "The vault code is 4417203. The garden has roses.", "question": "What is the vault code?",
             "needle": "4417203"},
            {"context": "Ships: the Orca left at dawn. The code word is lantern.", "question": "What is the code word?",
             "needle": "lantern"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return str(p)


# --- polykv codecs -------------------------------------------------------------------------------

def test_codecs_json():
    obj = run_json(["codecs", "--head-dim", "64"])
    rows = {r["name"]: r for r in obj["types"]}
    assert tuple(rows) == KV_TYPES
    # DESIGN §3 bits per value at head_dim 64 (turbo group G = 64)
    want = {"f16": 16, "bf16": 16, "q8_0": 8.5, "q4_0": 4.5, "turbo8": 8.25, "turbo4": 4.25, "turbo3": 3.25,
            "turbo2": 2.25}
    for name, r in rows.items():
        assert r["bits_per_value"] == pytest.approx(want[name]), name
        assert finite(r["rel_mse_gaussian"]) and 0 <= r["rel_mse_gaussian"] < 0.2, r
        assert finite(r["cosine_gaussian"]) and 0.9 < r["cosine_gaussian"] <= 1.0, r
    # fewer bits, more error (the ladder of DESIGN §1)
    mse = [rows[n]["rel_mse_gaussian"] for n in ("q8_0", "turbo4", "turbo3", "turbo2")]
    assert mse == sorted(mse) and rows["turbo3"]["rel_mse_gaussian"] == pytest.approx(0.0345, rel=0.1)


def test_codecs_bad_type_of_option_is_refused():
    res = run_cli(["codecs", "--head-dim", "sixty", "--json"], ok=False)
    assert res.exit_code == 2 and "head-dim" in res.output


# --- polykv eval ... -----------------------------------------------------------------------------

def test_eval_ppl_json_with_text_file(tiny_dir, tmp_path):
    from polykv.eval.common import load_text

    text = tmp_path / "t.txt"
    text.write_text(load_text(None)[:20000], encoding="utf-8")
    obj = run_json(["eval", "ppl", "--k", "q8_0", "--v", "turbo3", "--ctx", "128", "--windows", "2",
                    "--model", tiny_dir, "--text", str(text)])
    assert obj["tokens"] == 2 * 64
    assert finite(obj["ppl"]) and finite(obj["ppl_ref"]) and obj["ppl"] > 1 and obj["ppl_ref"] > 1
    assert obj["delta_pct"] == pytest.approx((obj["ppl"] / obj["ppl_ref"] - 1) * 100)
    res = run_cli(["eval", "ppl", "--k", "q8_0", "--v", "nope", "--model", tiny_dir, "--json"], ok=False)
    assert res.exit_code != 0 and "valid types" in res.output


def test_eval_equiv_json_with_prompts_file(tiny_dir, prompts_file):
    obj = run_json(["eval", "equiv", "--k", "q8_0", "--v", "turbo3", "--model", tiny_dir,
                    "--prompts", prompts_file, "--max-new-tokens", "2"])
    assert obj["n"] == 2 and obj["positions"] <= 4
    assert 0 <= obj["real_frac"] <= 1 and 0 <= obj["mean_tv"] <= obj["p95_tv"] + 1e-12 <= 1 + 1e-12
    assert isinstance(obj["recall_mismatch"], int) and 0 <= obj["recall_mismatch"] <= 2
    pass_ = obj["real_frac"] <= 0.15 and obj["recall_mismatch"] == 0 and obj["p95_tv"] < 0.30
    assert obj["verdict"] == ("PASS" if pass_ else "FAIL")


@pytest.mark.parametrize("task", ["niah", "vt"])
def test_eval_ruler_json(tiny_dir, task):
    obj = run_json(["eval", "ruler", "--task", task, "--ctx", "256", "--k", "q8_0", "--v", "turbo3",
                    "--samples", "2", "--model", tiny_dir])
    assert obj["samples"] == 2
    assert obj["score"] in (0.0, 50.0, 100.0) and obj["score_ref"] in (0.0, 50.0, 100.0)
    res = run_cli(["eval", "ruler", "--task", "qa", "--model", tiny_dir, "--json"], ok=False)
    assert res.exit_code != 0 and "valid tasks: niah, vt" in res.output


def test_eval_tiers_json(tiny_dir, prompts_file):
    obj = run_json(["eval", "tiers", "--ctx", "128", "--windows", "1", "--model", tiny_dir,
                    "--prompts", prompts_file, "--limit", "1", "--max-new-tokens", "2"])
    rows = obj["rows"]
    assert {(r["k"], r["v"]) for r in rows if not r["innerq"]} >= {(t, t) for t in KV_TYPES if t != "bf16"}
    for r in rows:
        for f in ("bits_per_value", "kv_bytes", "ppl_delta_pct", "mean_tv", "real_frac", "p95_tv"):
            assert finite(r[f]), (r["label"], f, r[f])
        assert isinstance(r["recall_mismatch"], int)
    f16 = next(r for r in rows if (r["k"], r["v"]) == ("f16", "f16"))
    assert f16["bits_per_value"] == 16.0 and f16["ppl_delta_pct"] == 0.0
    # measured bytes follow the bits: the smallest tier holds the fewest bytes
    by_bits = sorted(rows, key=lambda r: r["bits_per_value"])
    assert by_bits[0]["kv_bytes"] < by_bits[-1]["kv_bytes"]


# --- polykv demo ---------------------------------------------------------------------------------

def test_demo_json(tiny_dir):
    obj = run_json(["demo", "--agents", "2", "--max-new-tokens", "4", "--model", tiny_dir])
    assert obj["agents"] == 2 and len(obj["answers"]) == 2 and all(isinstance(a, str) for a in obj["answers"])
    assert isinstance(obj["doc_tokens"], int) and obj["doc_tokens"] > 1000
    assert 0 < obj["kv_bytes_shared"] < obj["kv_bytes_naive_f16"]
    assert obj["ratio"] == pytest.approx(obj["kv_bytes_naive_f16"] / obj["kv_bytes_shared"], rel=1e-6)
    assert obj["ratio"] > 2  # 2 f16 copies vs one q8_0/turbo3 copy (6 bits/value) + 2 suffixes


def test_demo_preset_and_override(tiny_dir):
    """--preset picks the K/V types (DESIGN §5 presets); --k / --v override it."""
    base = ["demo", "--agents", "1", "--max-new-tokens", "2", "--model", tiny_dir]
    obj = run_json(base + ["--preset", "max"])
    assert (obj["k"], obj["v"], obj["preset"], obj["recent"]) == ("turbo3", "turbo2", "max", 8)  # as the API's
    obj2 = run_json(base + ["--preset", "max", "--v", "q8_0"])
    assert (obj2["k"], obj2["v"], obj2["recent"]) == ("turbo3", "q8_0", 8)
    assert obj["kv_bytes_shared"] < obj2["kv_bytes_shared"]
    plain = run_json(base)  # no preset: exactly --k / --v (default q8_0 / turbo3), no window
    assert (plain["k"], plain["v"], plain["preset"], plain["recent"]) == ("q8_0", "turbo3", None, 0)
    assert run_cli(base + ["--preset", "fast", "--json"], ok=False).exit_code != 0


@pytest.mark.parametrize("args,words", [
    (["codecs", "--head-dim", "96"], "turbo codecs need head_dim"),
    (["demo", "--k", "q9"], "unknown KV type 'q9'"),
    (["demo", "--preset", "fast"], "unknown preset 'fast'"),
    (["bench", "spec", "--workloads", "bogus"], "unknown workloads ['bogus']"),
    (["bench", "spec", "--methods", "bogus"], "unknown speculative method 'bogus'"),
    (["bench", "spec", "--recent", "-1"], "recent must be >= 0, got -1"),
    (["bench", "fanout", "--agents", "1,x"], "expected comma-separated integers, got '1,x'"),
])
def test_a_users_mistake_is_one_line(monkeypatch, capsys, args, words):
    """`polykv` (cli.main) tells a bad value in a line on stderr (no traceback), exit 2, before loading
    a model."""
    from polykv import cli

    monkeypatch.setattr(sys, "argv", ["polykv", *args, "--json"])
    monkeypatch.setattr("polykv.hf.loading.load_model", lambda *a, **kw: pytest.fail("loaded a model"))
    monkeypatch.delenv("POLYKV_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    # one line of ours, or click's own usage line + error box for an option's value
    assert e.value.code == 2 and words in err and "Traceback" not in err and len(err.strip().splitlines()) <= 5, err


def test_calibrate_json(tiny_dir, tmp_path):
    """Not a §6 contract command, but it writes the table `KVCache(innerq=...)` reads."""
    out = tmp_path / "iq.safetensors"
    obj = run_json(["calibrate", "--model", tiny_dir, "--out", str(out)])
    assert out.is_file() and obj["tokens"] == 2048
    assert set(obj["layers_scaled"]) <= {0, 1}


# --- GPU-only commands on a CPU machine ----------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_bench_attention_needs_a_gpu():
    res = run_cli(["bench", "attention", "--ctx", "64", "--json"], ok=False)
    text = " ".join(res.output.replace("\u2502", " ").split())  # rich's error box, re-flowed
    assert res.exit_code == 2 and "`polykv bench attention` needs a CUDA GPU" in text
    assert "{" not in res.stdout  # no JSON object on a refusal


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize("command", ["e2e", "offload"])
def test_bench_on_cuda_needs_a_gpu(command):
    res = run_cli(["bench", command, "--json"], ok=False)
    text = " ".join(res.output.replace("\u2502", " ").split())  # rich's error box, re-flowed
    assert res.exit_code == 2 and f"`polykv bench {command}` needs a CUDA GPU" in text and "--device cpu" in text
    assert "{" not in res.stdout


def test_bench_offload_cpu_smoke_json():
    """`polykv bench offload --device cpu --tiny`: one JSON object, rows per (agents, tier) with the
    DESIGN §6 fields; the host row measured with the document really in the host tier."""
    obj = run_json(["bench", "offload", "--device", "cpu", "--tiny", "--agents", "1", "--ctx", "128",
                    "--layers", "1", "--steps", "1", "--warmup", "0", "--stream-chunk-rows", "64"])
    assert [r["tier"] for r in obj["rows"]] == ["gpu", "host", "offloaded"]
    assert all({"agents", "ctx", "tier", "ms", "h2d_gbps", "h2d_peak_gbps"} <= set(r) for r in obj["rows"])
    assert obj["rows"][1]["doc_tier"] == "host" and obj["rows"][1]["ms"] > 0


# --- polykv serve --------------------------------------------------------------------------------

def test_serve_command_serves_and_stops_on_sigint(tiny_dir, tmp_path):
    """`python -m polykv serve` (no JSON contract): /health answers, a document can be added, SIGINT
    ends the process with status 0 and the store holds the saved pool."""
    import httpx

    from polykv.pool.persist import has_saved_pool
    from polykv.server import free_port

    port = free_port()
    store = tmp_path / "store"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "polykv", "serve", "--port", str(port), "--model", tiny_dir,
                             "--store", str(store), "--torch-threads", "1"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        r = httpx.post(url + "/v1/documents", json={"text": "A short note about lighthouses.", "name": "n"},
                       timeout=60)
        assert r.status_code == 200 and r.json()["tokens"] > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
    assert has_saved_pool(store)
